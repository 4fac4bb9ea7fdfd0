"""Silent data corruption: replicas that should hold the same weights compare a fingerprint.

A bit flipped in memory or by a faulty unit changes one replica's weights and nothing else: the
loss stays finite and plausible, the health check sees nothing, and the replicas drift apart
for good. Every `ft.check_interval` steps (and before every checkpoint, so that each checkpoint
is one whose replicas agreed) each rank sums the bit patterns of its weights, position-weighted,
in int64: any single flipped bit changes the sum, and it costs one read of the weights. The
ranks that hold the same shard compare:

- the data-parallel replicas of DDP / HSDP (the `dp_replicate` dimension of the mesh);
- under [ft], the same rank of every live replica group (forja/train/ft/replicas.py).

A mismatch names the ranks that differ from the others (with two replicas, both: a pair cannot
tell which is right). With train.rollback.max > 0 the run goes back to its latest checkpoint
(forja/train/resilience/recovery.py), else it stops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from forja.train.step.rerun import FLIPPED_BIT, fingerprint, flip_bit


def _held(parts: list[nn.Module]) -> list[torch.Tensor]:
    """This rank's weights, each once (tied ones too), as plain local tensors, in model order."""
    seen: dict[int, torch.Tensor] = {}
    for part in parts:
        for p in part.parameters():
            seen.setdefault(id(p), p.detach().to_local() if isinstance(p, DTensor) else p.detach())
    return list(seen.values())


def weights_fingerprint(parts: list[nn.Module]) -> int:
    """The sum of the bit patterns of this rank's weights, each tensor's sum weighted by its
    position (so two swapped tensors differ too), modulo 2**64."""
    return int(fingerprint(_held(parts)))  # the one host sync


def flip_one_bit(parts: list[nn.Module]) -> str:
    """The `bitflip` drill: bit FLIPPED_BIT of the first element of this rank's first weight."""
    w = _held(parts)[0]
    flip_bit(w)
    return f"bit {FLIPPED_BIT} of the first element of its first weight, {tuple(w.shape)}"


def odd_ones(values: list[int]) -> list[int]:
    """The positions whose value differs from the most common one; every position when no value
    holds a strict majority (a pair of replicas cannot tell which is right). Empty: all agree."""
    counts = Counter(values).most_common()
    if len(counts) == 1:
        return []
    if counts[0][1] == counts[1][1]:
        return list(range(len(values)))
    return [i for i, v in enumerate(values) if v != counts[0][0]]


class FingerprintCheck:
    """When the check runs, and the comparison across this rank's replicas. `across_groups`, under
    [ft], gathers the fingerprints of this rank in every live group (Replicas.gather)."""

    def __init__(self, interval: int, *, replicate_group: dist.ProcessGroup | None,
                 across_groups: Callable[[int], list[int] | None] | None = None):
        self.interval = interval
        self.group, self.across_groups = replicate_group, across_groups
        self.checks = 0

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and (self.group is not None or self.across_groups is not None)

    def due(self, step: int, *, saves: bool) -> bool:
        """Every `interval` steps, and before a checkpoint (so each one holds agreed weights)."""
        return self.enabled and (step % self.interval == 0 or saves)

    def compare(self, parts: list[nn.Module]) -> str | None:
        """Every rank's verdict, the same on all ranks: None when the replicas agree, else the
        sentence naming those that differ."""
        mine = weights_fingerprint(parts)
        self.checks += 1
        found = self._within(mine) if self.group is not None else None
        if found is None and self.across_groups is not None:
            found = self._between_groups(mine)
        return _agree_on(found)

    def _within(self, mine: int) -> str | None:
        ranks = dist.get_process_group_ranks(self.group)
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in ranks]
        dist.all_gather(gathered, _as_pair(mine), group=self.group)
        values = [_from_pair(t) for t in gathered]
        odd = odd_ones(values)
        if not odd:
            return None
        if len(odd) == len(values):
            return (f"the data-parallel replicas rank {' and rank '.join(map(str, ranks))} hold different weights "
                    "(with no majority, which one is wrong cannot be told)")
        return (f"the weights of rank {', '.join(str(ranks[i]) for i in odd)} differ from those of its "
                f"data-parallel replicas (ranks {', '.join(map(str, ranks))})")

    def _between_groups(self, mine: int) -> str | None:
        values = self.across_groups(mine)
        if values is None:  # a group was lost during the exchange: checked again next time
            return None
        odd = odd_ones(values)
        if not odd:
            return None
        return (f"rank {dist.get_rank()} of replica group(s) {', '.join(map(str, odd))} holds weights that differ "
                f"from the same rank of the other live groups ({len(values)} compared)")


def _as_pair(value: int) -> torch.Tensor:
    """An unsigned 64-bit value as two int64 halves (Gloo reduces and gathers int64 exactly)."""
    value %= 1 << 64
    return torch.tensor([value >> 32, value & 0xFFFFFFFF], dtype=torch.int64)


def _from_pair(t: torch.Tensor) -> int:
    return (int(t[0]) << 32) | int(t[1])


def _agree_on(found: str | None) -> str | None:
    """The verdict of every rank of the job, or of the group under [ft]: the ranks compare in
    their own replica sets, and any mismatch is every rank's (so all roll back together)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return found
    texts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, found)
    said = [t for t in texts if t]
    return "; ".join(dict.fromkeys(said)) if said else None
