"""The collectives context parallelism differentiates through, on any backend (Gloo, NCCL).

`all_to_all` swaps a tensor's leading dimension over the group (forja/parallel/ep.py's, whose
backward is the exchange the other way); `all_gather` stacks every rank's tensor (the backward adds
up every rank's gradient and keeps this rank's share); `RingExchange` sends to the next rank
and receives from the previous one, asynchronously, for ring attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forja.parallel.ep import all_to_all as expert_all_to_all


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x (cp, ...): piece j goes to rank j; returns (cp, ...), piece j from rank j (expert
    parallelism's differentiable all-to-all, one row of pieces each way)."""
    ones = [1] * x.shape[0]
    return expert_all_to_all(x, ones, ones, group)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x (B, n, Tl, d), this rank's Tl tokens of every head -> (B, n / cp, cp Tl, d), the
    whole rows (in order: rank j's chunk is chunk j) of this rank's n / cp heads."""
    cp = dist.get_world_size(group)
    B, n, Tl, d = x.shape
    pieces = x.reshape(B, cp, n // cp, Tl, d).transpose(0, 1)  # (cp, B, n/cp, Tl, d): piece j -> rank j
    got = all_to_all(pieces, group)  # (cp, B, n/cp, Tl, d): piece j is chunk j of the row
    return got.permute(1, 2, 0, 3, 4).reshape(B, n // cp, cp * Tl, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: x (B, h, T, d) -> (B, h cp, T / cp, d)."""
    cp = dist.get_world_size(group)
    B, h, T, d = x.shape
    pieces = x.reshape(B, h, cp, T // cp, d).permute(2, 0, 1, 3, 4)  # (cp, B, h, Tl, d): chunk j -> rank j
    got = all_to_all(pieces, group)  # (cp, B, h, Tl, d): piece j holds rank j's heads
    return got.transpose(0, 1).reshape(B, cp * h, T // cp, d)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank used every rank's piece: this rank's gradient is the sum of theirs
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(cp, *x.shape): every rank's x, by rank."""
    return _AllGather.apply(x, group)


class RingExchange:
    """Point-to-point sends to the next rank of the group and receives from the previous."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (me + 1) % cp)
        self.prev = dist.get_global_rank(group, (me - 1) % cp)

    def start(self, tensors: tuple[torch.Tensor, ...], tag: int = 0) -> _Pending:
        """Send `tensors` on and receive the previous rank's of the same shapes; `wait()` on
        the result gives them. Exchanges in flight together need different tags."""
        sent = tuple(t.contiguous() for t in tensors)
        if self.next == dist.get_rank():  # a ring of one (cp 1, e.g. on one GPU): what goes round comes back
            return _Pending([], sent, sent)
        got = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(sent)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(got)]
        return _Pending(dist.batch_isend_irecv(ops), got, sent)


class _Pending:
    def __init__(self, works: list, got: tuple[torch.Tensor, ...], sent: tuple[torch.Tensor, ...]):
        self.works, self.got, self.sent = works, got, sent  # `sent` kept alive until done

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        return self.got
