"""A mixture of experts rehearsed: routing balanced by construction.

A router decides each expert's share of the tokens from its values, and a fake tensor holds
none. So the rehearsal routes as a perfectly balanced router would (the load that the
auxiliary loss and the bias update steer towards): every expert gets the same share of the
token-slots, and every expert-parallel rank sends and receives the same number of rows.
Two places read values, and only those are replaced while a rehearsal runs:

- `torch.bincount` (slots per expert: its output's shape depends on the values) on a fake
  tensor gives `minlength` counts; on a real tensor it is torch's;
- `ExpertDispatch.split_sizes` (forja/parallel/ep.py: the split sizes of the all-to-all, on
  the host) gives each rank an even share of the rows.

What is measured is then the balanced step, which is what the planner prices. A real step
also carries its imbalance: the busiest expert's rows, up to the whole batch at worst.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from forja.parallel.ep import ExpertDispatch

ROUTING_NOTE = ("mixture of experts routed as a balanced router would (every expert the same share of the "
                "token-slots): the rehearsal cannot see the router's values; a real step adds its imbalance")


def even_shares(rows: int, parts: int) -> list[int]:
    """`rows` split over `parts` as evenly as whole rows allow."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    bincount, split_sizes = torch.bincount, ExpertDispatch.__dict__["split_sizes"]

    def balanced_bincount(input, weights=None, minlength=0):  # noqa: A002 (torch's own names)
        if not isinstance(input, FakeTensor):
            return bincount(input, weights, minlength)
        n = max(minlength, 1)
        return torch.full((n,), input.numel() // n, dtype=torch.long, device=input.device)  # (n,)

    def balanced_split_sizes(sending: torch.Tensor, received: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
        return even_shares(rows, sending.shape[0]), even_shares(rows, received.shape[0])

    torch.bincount = balanced_bincount
    ExpertDispatch.split_sizes = staticmethod(balanced_split_sizes)
    try:
        yield
    finally:
        torch.bincount = bincount
        ExpertDispatch.split_sizes = split_sizes

