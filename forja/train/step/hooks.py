"""Step hooks: what runs around each step besides the model, and how their numbers travel.

A mixture of experts' balancing (experts.py), multi-token prediction's losses (mtp.py), the
attention logits and QK-clip (attention_logits.py) and fp16's loss scale (scaler.py) each do
the same four things at the same moments of a step, so each is a `StepHook` in the engine's
one list:

    begin(share)         before the forwards, with the hook's share of the batch (`StepShare`)
    record(tally)        after the backward passes: the step's device values, each with how it
                         is reduced over ranks (`Reduce`: sum, mean or max)
    refuses(loss, norm)  whether the step must not reach the weights (fp16's overflow)
    end(done)            after the optimizer step (or its skip): act on the reduced values (the
                         router's bias, QK-clip's weights), return the metrics by name

The engine packs what every hook recorded, the step's loss with it, into one collective per
reduce type and dtype (`Tally.reduce`: a sum over the data ranks, and over the pipeline stages
where a value is laid out over the whole model, zeros where another stage holds it; a max over
every rank), and brings everything the hooks want to see to the host in the step's one sync
(`Tally.fetch`): the host receives numbers, never tensors to read one by one. A hook may
bring less than it reduced, a function of the reduced value computed on the device
(`Tally.add(..., host=...)`). The loss scale, the router's bias and QK-clip's scaling stay on
the device: no other sync.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from forja.parallel import ParallelDims
from forja.parallel.process_group import rehearsing


@dataclass(frozen=True)
class StepShare:
    """What a hook is told when a step begins."""

    microbatches: int = 1
    """This rank's micro-batches in the step (each adds 1/microbatches of its loss)."""
    loss_scale: float = 1.0
    """The factor on every loss term of the step (fp16's loss scale; 1 otherwise)."""

    @property
    def aux_loss_share(self) -> float:
        """What an auxiliary loss of one micro-batch enters the gradients with."""
        return self.loss_scale / self.microbatches


@dataclass(frozen=True)
class StepDone:
    """What a hook is told when a step has ended."""

    stepped: bool
    """The optimizer stepped (the weights moved); False for a skipped step."""


class Reduce(enum.Enum):
    """How a recorded value is made whole over the ranks."""

    SUM = "sum"
    """Added up over the data-parallel ranks (dp x cp) and the pipeline stages (a stage holding
    none of it contributes zeros). Tensor-parallel ranks hold the same value and are not added."""
    MEAN = "mean"
    """The SUM divided by the number of data-parallel ranks."""
    MAX = "max"
    """The largest over every rank (-inf where a rank holds none of it)."""


class Entry:
    """One recorded value: `device` is it made whole (after `Tally.reduce`), `host` what its
    `host` function made of it, as Python floats in row-major order (after `Tally.fetch`)."""

    def __init__(self, value: torch.Tensor, reduce: Reduce | None, host: Callable | bool):
        self.value, self.reduce, self.show = value, reduce, host
        self.device: torch.Tensor = value
        self.host: list[float] = []


class Tally:
    """The values of one step that cross ranks or reach the host, packed."""

    def __init__(self):
        self.entries: list[Entry] = []

    def add(self, value: torch.Tensor, reduce: Reduce | None,
            host: Callable[[torch.Tensor], torch.Tensor] | bool = True) -> Entry:
        """Record `value` (on the device), reduced as `reduce` (None: already whole). `host`: True
        to bring the reduced value to the host, False not to, or a function of the reduced value
        (on the device) giving what to bring."""
        entry = Entry(value, reduce, host)
        self.entries.append(entry)
        return entry

    def reduce(self, groups: ReduceGroups) -> int:
        """Make every entry whole: one collective per reduce type and dtype (a pipeline adds one
        per sum). Returns the collectives made."""
        buckets: dict[tuple[str, torch.dtype], list[Entry]] = {}
        for e in self.entries:
            if e.reduce is not None:
                kind = "max" if e.reduce is Reduce.MAX else "sum"
                buckets.setdefault((kind, e.value.dtype), []).append(e)
        made = 0
        for (kind, _), entries in buckets.items():
            flat = torch.cat([e.value.reshape(-1) for e in entries])  # (sum of numels,)
            over = groups.for_max if kind == "max" else groups.for_sum
            for group in over:
                dist.all_reduce(flat, op=dist.ReduceOp.MAX if kind == "max" else dist.ReduceOp.SUM, group=group)
            made += len(over)
            offset = 0
            for e in entries:
                n = e.value.numel()
                e.device = flat[offset:offset + n].view_as(e.value)
                if e.reduce is Reduce.MEAN and groups.data_ranks > 1:
                    e.device = e.device / groups.data_ranks
                offset += n
        return made

    def fetch(self) -> None:
        """The step's one host sync: what every entry shows, in one transfer."""
        shown = [(e, _shown(e)) for e in self.entries]
        shown = [(e, t) for e, t in shown if t is not None]
        if not shown:
            return
        # float64 holds every float32, bfloat16 and float16 value exactly: the numbers are the tensors'.
        values = torch.cat([t.reshape(-1).to(torch.float64) for _, t in shown])
        # A rehearsal's tensors have shapes but no values (forja/train/rehearse.py): it reads zeros.
        values = [0.0] * values.numel() if rehearsing() else values.tolist()
        offset = 0
        for e, t in shown:
            e.host = values[offset:offset + t.numel()]
            offset += t.numel()


def _shown(entry: Entry) -> torch.Tensor | None:
    if entry.show is True:
        return entry.device
    return entry.show(entry.device) if callable(entry.show) else None


@dataclass(frozen=True)
class ReduceGroups:
    """The groups a step's values are reduced over, in order, looked up once when the engine is
    built (a device mesh makes a new slice at each lookup)."""

    for_sum: tuple[dist.ProcessGroup | None, ...]
    """The pipeline's stages (zeros where a stage holds nothing: this adds nothing up, it gathers),
    then the data ranks; those of one rank left out."""
    for_max: tuple[dist.ProcessGroup | None, ...]
    """Every rank at once (None: the default group), unless there is one."""
    data_ranks: int
    """The ranks a MEAN divides by: those that saw different data (dp x cp)."""

    @classmethod
    def of(cls, dims: ParallelDims) -> ReduceGroups:
        data_ranks = _size(dims.loss_group)
        stages = (dims.pp_group,) if dims.pp > 1 else ()
        return cls(for_sum=stages + ((dims.loss_group,) if data_ranks > 1 else ()),
                   for_max=(None,) if _size(None) > 1 else (), data_ranks=data_ranks)

    @classmethod
    def alone(cls) -> ReduceGroups:
        """One process: every value is already whole."""
        return cls(for_sum=(), for_max=(), data_ranks=1)


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class StepHook:
    """One per-step helper of the step engine. Every method has a default that does nothing, so
    a hook overrides the moments it needs; all ranks run the same hooks with values of the same
    shapes (the collectives pair up)."""

    @property
    def loss_scale(self) -> float:
        """The factor this hook puts on the step's loss (fp16's scale; 1 for most)."""
        return 1.0

    def begin(self, share: StepShare) -> None:
        """Before the step's forwards."""

    def record(self, tally: Tally) -> None:
        """After the backward passes: add this step's device values to `tally`."""

    def refuses(self, loss: float, grad_norm: float) -> bool:
        """Whether the step must not reach the weights, before the guard is asked."""
        return False

    def end(self, done: StepDone) -> dict[str, float]:
        """After the optimizer step or its skip: act on the reduced values; the step's metrics."""
        return {}

    def stateful(self) -> dict:
        """What of this hook a checkpoint saves and restores, by name (Stateful objects)."""
        return {}
