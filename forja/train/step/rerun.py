"""Silent data corruption a gradient carries: a sampled step run again on the same data.

A unit that computes one wrong value in a forward or a backward leaves the replicas' weights
equal (the wrong gradient is averaged into every one of them), so comparing weights
(forja/train/resilience/fingerprint.py) cannot see it. Every `ft.rerun_interval` steps the
engine runs the step's forward and backward a second time, on the same micro-batches from the
same RNG state, and each rank compares the two results bit for bit: its loss and a fingerprint
of the gradients it holds (the position-weighted bit sum of `fingerprint`). As Megatron-LM's
rerun state machine does, on the same rank:

    the two agree          the step goes on
    they differ            a third run decides: agreeing with one of them, the other met a
                           transient fault, and the step goes on with the agreeing result (the
                           rank is named and the event recorded); agreeing with neither, this
                           rank does not compute the same thing twice (a faulty device): stop

The ranks named are those whose loss differed (the fault arose in their forward; every gradient
after it follows, on their data-parallel peers too), else those whose gradients differed.

Cost per sampled step: one more forward and backward (two when the runs differ), two reads of
the gradients and one all-gather of two numbers per rank; with ft.rerun_interval = N about 1/N
more compute (bench/RESULTS.md). It needs a step that is deterministic on its device; on CPU
every step is. A fault that gives the same wrong value on every run (a unit stuck wrong) is
reproducible and passes: comparing on another device is what would tell it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_AS_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
FLIPPED_BIT = 10
"""The bit the flip drills flip: a low mantissa bit of a float32 value (about 1e-4 of it: silent,
the loss moves by far less than a spike)."""


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the bit patterns of `tensors`, each tensor's sum weighted by its position (so
    two swapped tensors differ too), as an int64 on their device (exact modulo 2**64: it wraps).
    Any single flipped bit changes it. No host sync."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for index, t in enumerate(tensors):
        bits = t.detach().contiguous().view(_AS_INT[t.element_size()])
        total += bits.sum(dtype=torch.int64) * (2 * index + 1)
    return total


def flip_bit(t: torch.Tensor) -> None:
    """Flip bit FLIPPED_BIT of the first element of `t`, in place."""
    with torch.no_grad():
        t.view(-1)[:1].view(_AS_INT[t.element_size()]).bitwise_xor_(1 << FLIPPED_BIT)


@contextlib.contextmanager
def flipped_activation(part: nn.Module | None):
    """The activation flip drill: one bit of the output of `part`'s first block flips (None: no drill)."""
    if part is None:
        yield
        return

    def flip(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()  # a new tensor: autograd saved nothing of it yet
        flip_bit(out.to_local() if isinstance(out, DTensor) else out)
        return out

    handle = next(iter(part.layers.values())).register_forward_hook(flip)
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True)
class RerunVerdict:
    """A sampled step whose rerun differed from its first run."""

    text: str
    """Which ranks' loss or gradients differed, and what the third run said."""
    reproducible: bool
    """True: a third run agreed with one of the two (a transient fault; the step keeps the agreeing
    result). False: some rank gave three different results (its device computes wrongly)."""


class Rerun:
    """The rerun of one sampled step. `one_pass(first)` zeroes the gradients and runs the step's
    forward and backward, returning this rank's loss; `grads()` lists the gradients it holds;
    `blocks` are this rank's blocks, whose outputs are fingerprinted in each run (a forward fault
    shows there on its own rank, before a gradient reduction carries it to the others)."""

    def __init__(self, one_pass: Callable[[bool], torch.Tensor], grads: Callable[[], list[torch.Tensor]],
                 blocks: list[nn.Module], device: torch.device):
        self.one_pass, self.grads, self.blocks, self.device = one_pass, grads, blocks, device

    def run(self) -> tuple[torch.Tensor, RerunVerdict | None]:
        """Run the step twice (three times when they differ); returns the loss of the result the
        gradients now hold, and the verdict when the runs differed (None: they agreed)."""
        rng = _rng_state(self.device)
        loss, first = self._digested(True)
        _set_rng_state(self.device, rng)
        loss, second = self._digested(False)
        differs = (first != second).to(torch.int64)  # (3,): the loss, the activations, the gradients
        if not _gather(differs).any():
            return loss, None
        _set_rng_state(self.device, rng)
        loss, third = self._digested(False)
        # Bad on this rank: the third run agrees with neither, or the first two agreed and the
        # third stands alone (the gradients held are then the faulty result).
        same = [bool((third == other).all()) for other in (first, second)]
        bad = not any(same) or (not differs.any() and not same[0])
        table = _gather(torch.cat([differs, torch.tensor([int(bad)], device=differs.device)]))  # (world, 4)
        return loss, _verdict(table.tolist())

    def _digested(self, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One run: its loss, and (loss bits, block outputs' fingerprint, gradients'), (3,) int64."""
        seen = torch.zeros((), dtype=torch.int64, device=self.device)

        def add(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen.add_(fingerprint([out.to_local() if isinstance(out, DTensor) else out]))

        handles = [block.register_forward_hook(add) for block in self.blocks]
        try:
            loss = self.one_pass(first)
        finally:
            for handle in handles:
                handle.remove()
        loss_bits = loss.detach().float().view(torch.int32).to(torch.int64)
        return loss, torch.stack([loss_bits, seen, fingerprint(self.grads()).to(self.device)])


def _verdict(rows: list[list[int]]) -> RerunVerdict:
    """The sentence every rank reports, from each rank's (loss, activations, gradients differed; bad)."""
    forward = [r for r, row in enumerate(rows) if row[0] or row[1]]
    named = forward or [r for r, row in enumerate(rows) if row[2]]
    what = "forward (its blocks' outputs)" if forward else "gradients"
    ranks = ", ".join(map(str, named))
    bad = [r for r, row in enumerate(rows) if row[3]]
    if bad:
        return RerunVerdict(f"rank {', '.join(map(str, bad))} gave different results in three runs of the same "
                            "step on the same data: its device does not compute the same thing twice", False)
    return RerunVerdict(f"the {what} of rank {ranks} differed between the step and its rerun on the same data; a "
                        "third run agreed with one of them: a transient fault, the step kept the agreeing result",
                        True)


def _gather(values: torch.Tensor) -> torch.Tensor:
    """(world, n): every rank's `values` (n,), the same on all ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values.unsqueeze(0)
    out = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(out, values)
    return torch.stack(out)


def _rng_state(device: torch.device) -> tuple:
    """The generators a step draws from (dropout, routing noise): the host's and the device's."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
