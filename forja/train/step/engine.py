"""The step engine: how one optimizer step and one validation forward run on this rank.

Built once from the config (`build_engine`): the model parts, their optimizers and
schedule, the compute dtype, the loss settings and the process groups of `ParallelDims`.
The trainer then makes two calls and never asks how the model is laid out:

    engine.train_step(batches, scales=StepScales(...)) -> StepOutput
                                                 forward + backward of the step's micro-batches,
                                                 tied copies summed, clip, optimizer + schedule step
    engine.eval_loss(batch)   -> 0-dim tensor    one micro-batch's mean loss, forward only
    engine.logits(tokens)     -> (B, T, V) | None   forward only, for downstream evaluation

`StepEngine` runs a whole model per rank (one process, DDP/FSDP/HSDP, TP, CP);
`PipelineEngine` (pipelined.py) runs this rank's pipeline stages through the schedule.

The loss of a step is the mean next-token cross-entropy over every token of the global
batch. Every micro-batch has the same number of tokens (packed sequences, no padding), so
each contributes its mean divided by the number of micro-batches (`microbatch_loss`, the
one place a micro-batch's loss is composed; a mixture of experts' auxiliary losses enter the
gradients with the same share, and so do multi-token prediction's: the engine sets it in the
`StepContext` it handed the model's modules when it was built,
forja/models/common/step_context.py), and averaging over the data-parallel ranks (FSDP's
gradient reduction, and a mean over `loss_group` for the reported value) makes it the global
mean: any layout computes the loss and gradients of one process.

What runs around a step besides the model is a list of step hooks (forja/train/step/hooks.py):
a mixture of experts' balancing (experts.py), multi-token prediction's losses (mtp.py), the
attention logits and QK-clip (attention_logits.py) and fp16's loss scale (scaler.py). Their
values cross ranks packed with the step's loss, one collective per reduce type and dtype, and
reach the host with the loss and the gradient norm in the step's one host sync. With padding (data.packing =
"best-fit") micro-batches hold different numbers of labels; each mean is then weighed by its
share of the step's labels (`_label_share`), so the loss is still the mean over every label of
the global batch, on every layout (the pipeline's schedule hands each micro-batch's labels to
`_pipeline_loss`).

What scales a step comes from two places. The engine owns the loss scale (fp16's,
forja/train/step/scaler.py, a hook; the auxiliary losses get it too): `microbatch_loss`
multiplies by it and the step divides the gradients and the reported loss by it again before
the norm, so the guard, the clipping and the logs see unscaled values. Its caller hands it one
`StepScales`: a drill's fault on this rank's loss (forja/train/resilience/drills.py) and a
factor on the learning rate (a rollback's, forja/train/resilience/recovery.py). A finite loss
with an inf/NaN gradient norm is an overflow, the scaler's business: the step is skipped, the
scale halved, and the guard (forja/train/resilience/recovery.py) is not asked. The guard only
says whether a step may reach the weights; what was wrong with it stays with recovery.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from forja import fallbacks
from forja.checkpoint.states import stored_names
from forja.models.common.mtp import IGNORE
from forja.models.common.step_context import StepContext, share_context
from forja.models.common.transformer import Transformer
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.parallel import ParallelDims, local_value, loss_context
from forja.parallel.cp import ContextParallel, LocalPart
from forja.parallel.fsdp import hold_gradients
from forja.train.step.attention_logits import AttentionLogits
from forja.train.step.experts import ExpertBalance
from forja.train.step.groups import ReplicaGroups, Share
from forja.train.step.hooks import Reduce, ReduceGroups, StepDone, StepHook, StepShare, Tally
from forja.train.step.mtp import MTPLosses
from forja.train.step.rerun import Rerun, RerunVerdict, flip_bit, flipped_activation
from forja.train.step.scaler import LossScaler, LossScaling, unscale_


@dataclass(frozen=True)
class StepScales:
    """What one step is scaled by, computed by the caller for each step (the loss scale is the
    engine's own)."""

    fault: float = 1.0
    """A drill's factor on this rank's loss (NaN, or forja/train/resilience/drills.py's SPIKE_FACTOR); kept, so the
    guard sees it."""
    lr: float = 1.0
    """Multiplies every learning rate for this step (the schedule sets them afresh at its next step)."""
    flip: str | None = None
    """A drill's flipped bit in this rank's first run of the step: "gradient" (one value of its
    gradients after the backward) or "activation" (one value of its first block's output)."""


@dataclass
class StepOutput:
    """What one optimizer step did."""

    loss: float
    """Mean loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    """Tokens processed by all ranks this step."""
    lr: float
    """Learning rate the step used."""
    skipped: bool
    """The loss or the norm was not finite (an fp16 overflow among them), or the guard refused them:
    the weights were left unchanged."""
    committed: bool = True
    """False when a fault-tolerant replica group did not finish the step (forja/train/ft): nothing
    stepped, not even the schedule, and the step is to be trained again by the groups left."""
    rerun: RerunVerdict | None = None
    """A sampled step whose rerun differed from its first run (forja/train/step/rerun.py)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Further figures of the step (a mixture of experts' load and auxiliary losses, multi-token
    prediction's per-depth losses `mtp/loss_{k}`; under fp16
    `loss_scale`, the scale the step ran with, and `overflow`, 1.0 when it overflowed and was skipped)."""


def compute_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of train.precision on `device`, or None for full fp32."""
    if precision == "fp16":
        return torch.float16
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class StepEngine:
    """Steps of a model held whole by every rank (sharded or not)."""

    def __init__(self, parts: list[Transformer], optimizers: OptimizerGroup, scheduler: SchedulerGroup,
                 dims: ParallelDims, *, device: torch.device, compute_dtype: torch.dtype | None,
                 grad_clip: float, document_mask: bool, scaler: LossScaler | None = None,
                 replicas: ReplicaGroups | None = None,
                 grad_sync: str = "micro-batch"):
        self.parts, self.optimizers, self.scheduler, self.dims = parts, optimizers, scheduler, dims
        self.grad_sync = grad_sync  # parallel.grad_sync: FSDP reduces each micro-batch, or once a step
        self.replicas = replicas or ReplicaGroups()  # [ft]'s groups (forja/train/ft/replicas.py), or the one
        self.device, self.compute_dtype = device, compute_dtype
        self.grad_clip, self.document_mask = grad_clip, document_mask
        # context parallelism: each micro-batch's rows split over the cp group
        self.context = ContextParallel(dims.cp_mesh.get_group(), dims.cp_kind, device) if dims.cp > 1 else None
        self._norm_params = _each_weight_once(parts)
        _note_plain_flex(parts[0].args, document_mask)
        self._pp_group, self._reduce_groups = dims.pp_group, ReduceGroups.of(dims)  # looked up once
        attention = AttentionLogits(parts, dims, optimizers.cfg)  # attn/ metrics, QK-clip
        candidates = [ExpertBalance(parts, device), attention, MTPLosses(parts, device)]
        self.hooks: list[StepHook] = [h for h in candidates if h.enabled]  # in the order their metrics are listed
        if scaler is not None:  # fp16's loss scaling
            self.hooks.append(LossScaling(scaler))
        # What the modules read of the step in progress, handed to them once: the engine sets it per step.
        self.step_context = StepContext.for_engine(device, track_max_logit=attention.enabled)
        for part in parts:
            share_context(part, self.step_context)
        # The step in progress: a pipeline schedule keeps the loss function it was built with,
        # so microbatch_loss reads the step's scales here rather than from its arguments.
        self._scales, self._share = StepScales(), StepShare()

    @property
    def model(self) -> Transformer | None:
        """The whole model, when this rank holds it (not under pipeline parallelism)."""
        return self.parts[0]

    def stateful(self) -> dict:
        """What of the engine a checkpoint saves and restores, by name: fp16's loss scale ("scaler")."""
        return {name: state for hook in self.hooks for name, state in hook.stateful().items()}

    # -- one step ----------------------------------------------------------------------------
    def train_step(self, batches: Sequence, *, guard: Callable[[float, float], bool] | None = None,
                   scales: StepScales | None = None, rerun: bool = False,
                   replica_share: Share = Share()) -> StepOutput:
        """Forward and backward of `batches` (this rank's micro-batches of one step), then
        the optimizer step unless the loss or gradient norm is not finite or `guard(loss,
        grad_norm)` refuses them (returns True). Under fp16 an overflow skips the step without
        asking `guard`. With `rerun`, the forward and backward run again and the two results
        are compared (silent data corruption, forja/train/step/rerun.py). `replica_share`: the
        part of the job's batch `batches` are, under [ft] (the groups' begin_step said it)."""
        scales = scales or StepScales()
        share = self._begin(len(batches), scales)
        try:
            if rerun:
                blocks = [block for part in self.parts for block in part.layers.values()]
                loss, verdict = Rerun(lambda first: self._run(batches, share, first), self._local_grads, blocks,
                                      self.device).run()
            else:
                loss, verdict = self._run(batches, share, True), None
        finally:
            self._scales, self._share = StepScales(), StepShare()
        self.sync_tied_copies()
        together = self.replicas.every_step  # [ft] hsdp; diloco syncs apart, one group has nobody to average with
        if together:  # the live replica groups' mean gradient (each shard alike)
            self.replicas.average(self._local_grads())
        if share.loss_scale != 1.0:  # unscaled before the norm: it, clipping and the guard see true values
            loss = loss / share.loss_scale
            unscale_(self._local_grads(), share.loss_scale)
        loss_value, norm_value = self._tally(loss, self.clip_gradients(), together)
        lr = self.optimizers.optimizers[0].param_groups[0]["lr"]  # the schedule's, or a rollback's lowered one
        refused = [hook for hook in self.hooks if hook.refuses(loss_value, norm_value)]  # fp16's overflow
        vetoed = bool(guard(loss_value, norm_value)) if guard is not None and not refused else False
        skipped = bool(refused) or vetoed or not (math.isfinite(loss_value) and math.isfinite(norm_value))
        skipped = skipped or (verdict is not None and not verdict.reproducible)  # no good result to step with
        if together and not self.replicas.commit():  # a group failed mid-step
            self.optimizers.zero_grad(set_to_none=True)
            return StepOutput(loss=loss_value, grad_norm=norm_value, tokens=0, lr=lr, skipped=True,
                              committed=False)
        self._finish_step(skipped)
        metrics: dict[str, float] = {}
        for hook in self.hooks:  # after the optimizer step: the router's bias and QK-clip follow it
            metrics |= hook.end(StepDone(stepped=not skipped))
        tokens = sum(b.input_ids.numel() for b in batches) * self.dims.dp * replica_share.count
        return StepOutput(loss=loss_value, grad_norm=norm_value, tokens=tokens, lr=lr, skipped=skipped,
                          rerun=verdict, metrics=metrics)

    def _begin(self, n: int, scales: StepScales) -> StepShare:
        """The step's share, told to the hooks and the modules' context; the learning rates' factor."""
        if scales.lr != 1.0:
            for opt in self.optimizers.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * scales.lr
        share = StepShare(n, loss_scale=math.prod((hook.loss_scale for hook in self.hooks), start=1.0))
        self._scales, self._share = scales, share
        return share

    def _run(self, batches: Sequence, share: StepShare, first: bool) -> torch.Tensor:
        """One run of the step's forwards and backwards from zeroed gradients and fresh hooks; a
        flip drill acts in the first run only (a transient fault)."""
        self.optimizers.zero_grad(set_to_none=True)
        self.step_context.begin_step(share.aux_loss_share)
        for hook in self.hooks:
            hook.begin(share)
        flip = self._scales.flip if first else None
        with flipped_activation(self.parts[0] if flip == "activation" else None):
            loss = self.forward_backward(batches)
        if flip == "gradient" and (grads := self._local_grads()):
            flip_bit(grads[0])
        return loss

    def _tally(self, loss: torch.Tensor, norm: torch.Tensor, together: bool) -> tuple[float, float]:
        """The loss's mean over the data ranks (the norm is already global) and every hook's values,
        reduced in as few collectives as their reduce types allow, then the step's one host sync:
        whether to step depends on the values. Returns (loss, grad_norm) as numbers."""
        tally = Tally()
        loss_entry = tally.add(loss, Reduce.MEAN)  # first: its place in the packed sum is the same each step
        norm_entry = tally.add(norm.to(loss.device, loss.dtype), None)
        for hook in self.hooks:
            hook.record(tally)
        tally.reduce(self._reduce_groups)
        if together:
            self.replicas.average([loss_entry.device])
        tally.fetch()
        return loss_entry.host[0], norm_entry.host[0]

    def _finish_step(self, skipped: bool) -> None:
        """The optimizer step, or none; the schedule moves either way."""
        if not skipped:
            self.optimizers.step()
            self.scheduler.step()
            return
        self.optimizers.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # The schedule moves without an optimizer step, as intended; on a first step
            # torch would warn that the schedule's first value is then skipped.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()

    def _local_grads(self) -> list[torch.Tensor]:
        """Every gradient this rank holds, once each, as plain tensors (a DTensor's local shard:
        unscaling is elementwise, so no communication)."""
        held = {id(p): p for part in self.parts for p in part.parameters() if p.grad is not None}
        return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in held.values()]

    def microbatch_loss(self, loss: torch.Tensor, n: int) -> torch.Tensor:
        """What one of a step's `n` micro-batches adds to the step's loss, from its mean
        next-token cross-entropy `loss`. Auxiliary losses enter the gradients with this same
        share, set in the modules' step context by `_begin`. The step's scales apply here: a
        drill's fault on this rank (gradients and the reported loss both follow), then the loss
        scale (train_step divides the sum by it again)."""
        scales, loss_scale = self._scales, self._share.loss_scale
        if scales.fault != 1.0:
            loss = loss * scales.fault
        loss = loss / n
        return loss if loss_scale == 1.0 else loss * loss_scale

    def forward_backward(self, batches: Sequence) -> torch.Tensor:
        """Accumulate the gradients of `batches`; returns this rank's mean loss (0-dim; a
        pipeline's: the last stage's, zeros on the other stages)."""
        total = torch.zeros((), device=self.device)
        padded = self._padded(batches)
        for i, batch in enumerate(batches):
            if self.grad_sync == "step":
                hold_gradients(self.model, hold=i < len(batches) - 1)
            part = self._local_part(*self._inputs(batch))
            with self._loss_context():
                with self.autocast():
                    out = self.model(part.tokens, part.document_ids, positions=part.positions, labels=part.labels,
                                     sequence=part.sequence)
                    if padded:
                        out = out * self._label_share(part.labels, batch.step_labels, len(batches))
                    loss = self.microbatch_loss(out, len(batches))
                loss.backward()
            total += local_value(loss.detach())
        return total

    @torch.no_grad()
    def eval_loss(self, batch) -> torch.Tensor:
        """Mean loss of one micro-batch (0-dim), forward only."""
        tokens, labels, doc_ids = self._inputs(batch)
        with self.autocast(), self._loss_context():
            return local_value(self.model(tokens, doc_ids, labels=labels))

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Logits (B, T, V) of tokens (B, T), forward only, on the model as it is laid out: a
        DTensor sharded over the vocabulary under TP (never gathered), None on a pipeline rank
        without the last stage. Under context parallelism every rank of a cp group runs the
        whole (short) sequence, as validation does. Every rank of a model copy must call it
        with the same tokens; every rank of the run the same number of times (FSDP)."""
        with self.autocast():
            return self._logits(tokens)

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        return self.model(tokens)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model takes."""
        return self.parts[0].args.max_seq_len

    def sync_tied_copies(self) -> None:
        """Make the copies of a tied weight on different stages one again (pipeline only)."""

    def clip_gradients(self) -> torch.Tensor:
        """Clip the norm of all gradients of all parts, over all ranks, to train.grad_clip
        (0: no clipping); returns the norm before clipping."""
        counted = [p for p in self._norm_params if p.grad is not None]
        squares = [local_value(nn.utils.get_total_norm([p.grad for p in group], foreach=True)) ** 2
                   for group in _by_mesh(counted)]  # a DTensor's norm is reduced over its mesh here
        total = torch.stack(squares).sum()
        if self._pp_group is not None:  # each pipeline rank holds other layers: add up their squares
            dist.all_reduce(total, group=self._pp_group)
        total = total.sqrt()
        if self.grad_clip > 0:
            params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
            for group in _by_mesh(params):
                nn.utils.clip_grads_with_norm_(group, self.grad_clip, total, foreach=True)
        return total

    # -- helpers -----------------------------------------------------------------------------
    def _padded(self, batches: Sequence) -> bool:
        """Whether the step's samples hold padding (data.packing = "best-fit"): its labels are then
        fewer than its positions, and micro-batches hold different numbers of them."""
        step_labels = getattr(batches[0], "step_labels", 0)
        return bool(step_labels) and step_labels != sum(b.input_ids.numel() for b in batches) * self.dims.dp

    def _label_share(self, labels: torch.Tensor, step_labels: int, n: int) -> torch.Tensor:
        """What turns this rank's micro-batch mean into its part of the mean over the step's
        `step_labels` labels: its labels x n micro-batches x the ranks averaged over / step_labels.
        Without padding that is 1, and no factor is applied (bit-exact with packed windows)."""
        ranks = dist.get_world_size(self.dims.loss_group) if dist.is_initialized() else 1
        held = (labels != IGNORE).sum()  # a tensor: no host sync
        return held * (n * ranks / step_labels)

    def _local_part(self, tokens: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None) -> LocalPart:
        """What this rank runs of a micro-batch: under context parallelism its part of each
        row (the model mixes across the parts), else all of it."""
        if self.context is not None:
            return self.context.split(tokens, labels, doc_ids)
        positions = torch.arange(tokens.shape[1], device=self.device)  # (T,)
        return LocalPart(tokens, labels, doc_ids, positions, None)

    def _inputs(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens, labels, document ids or None), each (m, T), on the device."""
        tokens = batch.input_ids.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        doc_ids = batch.document_ids.to(self.device, non_blocking=True) if self.document_mask else None
        return tokens, labels, doc_ids

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        # No cast cache: autocast would keep every weight's bf16 copy until the forward ends, the
        # whole model's under FSDP and activation checkpointing (measured by the rehearsal,
        # forja/train/rehearse/); uncached, a matmul's backward keeps its own copy, and a
        # checkpointed block recomputes it. Each weight is cast once per forward either way.
        return torch.autocast(self.device.type, dtype=self.compute_dtype, cache_enabled=False)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Where the loss and its backward run: vocabulary-parallel cross-entropy under TP."""
        return loss_context(self.dims.tp)


def _each_weight_once(parts: list[Transformer]) -> list[nn.Parameter]:
    """The parameters the gradient norm counts: a pipeline stage's copy of a tied embedding
    (stored under the embedding's name) is a second holder of one weight, not a second weight."""
    params = []
    for part in parts:
        copies = stored_names(part, distinct=True)
        params += [p for name, p in part.named_parameters() if name not in copies]
    return params


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by device mesh (plain tensors together): foreach kernels and
    DTensor reductions need a list of one kind. Under TP without FSDP, for instance,
    norm weights are plain tensors and projections DTensors."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(groups.values())


def _note_plain_flex(args, document_mask: bool) -> None:
    """FlexAttention asked for rows it has nothing to mask in (no document ids, no window or
    chunk, no sinks): every mask is plain causal and SDPA's causal kernel runs it. Said in the fallback record."""
    windows = any(args.layer_type(i) in ("sliding_attention", "chunked_attention") for i in range(args.n_layers))
    if args.attention == "flex" and not (document_mask or windows or args.attention_sinks):
        fallbacks.record("attention.flex.causal", asked='model.attention = "flex"', instead="SDPA's causal kernel",
                         why="no document masks (model.document_mask = false), windows or sinks to apply",
                         fix="set model.document_mask = true for FlexAttention's document masks")
