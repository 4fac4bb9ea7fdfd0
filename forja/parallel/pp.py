"""Pipeline parallelism: the layers split into stages over the "pp" ranks, run by a
`torch.distributed.pipelining` schedule.

    build_pipeline: split the meta model (pp_split.py) -> keep this rank's stages ->
    prepare each (TP/AC/compile/FSDP, to_empty, init) -> one PipelineStage per part

Each `PipelineStage` wraps the part itself, not a wrapper module: the library recognizes
an FSDP-sharded part and only reduce-scatters its gradients after the last microbatch,
and the checkpoint sees the part's own parameter names.

Inputs besides the hidden states. Every stage masks attention by document, and the last
stage computes the loss inside the model, exactly as an unsplit model does (so the fused
linear cross-entropy works there too). Neither document ids nor labels travel between
stages: the pp ranks of one data-parallel position load the same batches (the loader is
split over dp ranks only), so each rank passes its own copy to the schedule as keyword
arguments, which the library splits into microbatches and gives to every stage's
forward; so do the token ids, for a model whose blocks read them (`stages_read_tokens`:
DeepSeek-V4's hash-routed experts). Only hidden states travel, so no integer tensor enters
the library's backward.

What a microbatch's loss counts for in the step (its share of the mean, auxiliary terms)
is the step engine's business: it hands `step` the function that turns the last stage's
output into the microbatch's loss. This file only runs stages.

Validation and downstream evaluation run forward only, one micro-batch at a time, through
the stages in order with plain point-to-point sends (`forward`), so they do not depend on
the training schedule's microbatch shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from forja.errors import ForjaError
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims
from forja.parallel.pp_split import (
    V_SCHEDULES,
    check_layers,
    layers_per_stage,
    rank_stages,
    stage_owners,
    stage_part,
    stages_per_rank,
)
from forja.versions import torch_version

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def _schedule(name: str):
    """torch's schedule class of parallel.pp_schedule `name`. (torch.distributed.pipelining is
    imported here, when a pipeline is built: it imports torch._dynamo, 0.7 s of every process's
    start that a run without a pipeline never needs.)"""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
            "zero-bubble": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[name]


def microbatch_error(schedule: str, pp: int, n: int, local_batch: int, source: str) -> str | None:
    """Why `n` microbatches of a local batch of `local_batch` sequences do not suit
    `schedule` over `pp` ranks (None when they do). `source` says where n came from."""
    fix = ("set parallel.pp_microbatches, or change train.global_batch_size / train.micro_batch_size "
           "(parallel.pp_microbatches = 0 means local batch / train.micro_batch_size)")
    if n < 1 or local_batch % n:
        return (f"the local batch of {local_batch} sequences (train.global_batch_size / data-parallel degree) "
                f"does not split into {n} equal microbatches ({source}); {fix}")
    need = {"1f1b": pp, "dualpipev": 2 * pp}.get(schedule, 1)
    if n < need:
        return (f"parallel.pp_schedule = '{schedule}' needs at least {need} microbatches per step over "
                f"parallel.pp = {pp} ranks, but gets {n} ({source}); {fix}")
    if schedule == "interleaved-1f1b" and n % max(1, n // pp):  # it runs rounds of pp microbatches
        return (f"parallel.pp_schedule = 'interleaved-1f1b' runs the microbatches in rounds, so their number n "
                f"must be divisible by n // parallel.pp (any multiple of {pp} is), but gets {n} ({source}); {fix}")
    return None


def microbatches(cfg: ParallelConfig, local_batch: int, micro_batch_size: int) -> tuple[int, str]:
    """(microbatches per step, where that number comes from, for messages)."""
    if cfg.pp_microbatches:
        return cfg.pp_microbatches, f"parallel.pp_microbatches = {cfg.pp_microbatches}"
    n = local_batch // micro_batch_size
    return n, f"local batch / train.micro_batch_size = {local_batch} / {micro_batch_size}"


def check_microbatches(cfg: ParallelConfig, dims: ParallelDims, *, global_batch_size: int,
                       micro_batch_size: int) -> None:
    """The schedule's needs of the batch, checked before anything starts (the pipeline checks
    them again on its first step, from the batches themselves)."""
    if dims.pp == 1:
        return
    local = global_batch_size // max(1, dims.dp)
    n, source = microbatches(cfg, local, micro_batch_size)
    error = microbatch_error(cfg.pp_schedule, dims.pp, n, local, source)
    if error:
        raise ForjaError(error)


def check_pipeline(args: TransformerArgs, dims: ParallelDims, cfg: ParallelConfig, *, device_type: str,
                   global_batch_size: int, micro_batch_size: int) -> None:
    """Every check of a pipeline layout that needs no model built, for before anything starts
    (build_pipeline repeats those of the model, and the pipeline those of the batch)."""
    if dims.pp == 1:
        return
    check_schedule(cfg, device_type)
    check_layers(args.n_layers, pp=dims.pp, schedule=cfg.pp_schedule, pp_layers=cfg.pp_layers,
                 spans=args.pipeline_spans())
    check_microbatches(cfg, dims, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)


def check_schedule(cfg: ParallelConfig, device_type: str) -> None:
    """`device_type`: "cuda" or "cpu", the ranks' kind of device."""
    if cfg.pp_schedule in V_SCHEDULES and device_type == "cpu" and torch_version() < (2, 12):
        # Before 2.12 the schedule's start-up handshake sends from a rank to itself (the bottom
        # of the V), which NCCL allows and Gloo does not.
        raise ForjaError(f"parallel.pp_schedule = '{cfg.pp_schedule}' on CPU (Gloo) needs PyTorch >= 2.12, "
                         f"this is {torch.__version__}; upgrade torch, or choose 1f1b, gpipe or interleaved-1f1b")
    if cfg.pp_schedule not in V_SCHEDULES:
        return
    split = f"parallel.pp_schedule = '{cfg.pp_schedule}' splits each backward into an input and a weight pass"
    if cfg.compile:
        raise ForjaError(f"{split}, which PyTorch's pipelining does not support with torch.compile'd blocks; set "
                         "parallel.compile = false, or choose the 1f1b or interleaved-1f1b schedule")
    if cfg.ac == "selective" and cfg.ac_every == 0:
        raise ForjaError(f"{split}, which op-level selective activation checkpointing does not allow (it backs "
                         "through a region once); use parallel.ac = 'full' or parallel.ac_every = k, or the 1f1b "
                         "or interleaved-1f1b schedule")


class Pipeline:
    """This rank's pipeline stages, and the schedule and point-to-point sends that run them."""

    def __init__(self, parts: list[Transformer], stage_ids: list[int], *, cfg: ParallelConfig,
                 dims: ParallelDims, device: torch.device):
        self.parts, self.stage_ids, self.cfg, self.device = parts, stage_ids, cfg, device
        self.n_stages = cfg.pp * stages_per_rank(cfg.pp_schedule)
        self.owners = stage_owners(cfg.pp, cfg.pp_schedule)
        self.group = dims.pp_group
        self.pp_rank = dims.pp_mesh.get_local_rank()
        # Under sequence parallelism a stage hands on this rank's slice of the sequence.
        self.sequence_split = dims.tp if dims.tp > 1 and cfg.sequence_parallel else 1
        # The residual stream's dtype: FSDP's compute dtype for the parameters (autocast's
        # matmul outputs are added to it, so an fp32 stream stays fp32).
        self.hidden_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
        self.has_first = 0 in stage_ids
        self.has_last = self.n_stages - 1 in stage_ids
        self._schedules: dict[int, object] = {}  # by sequence length (tokens per row on this rank)
        self._shape: tuple[int, int] | None = None  # (local batch, microbatches) the schedule runs

    @property
    def ends_on_one_rank(self) -> bool:
        """Whether the first and the last stage run on the same rank (V-shaped schedules)."""
        return self.owners[0] == self.owners[-1]

    # -- training ----------------------------------------------------------------------------
    def _stages(self, m: int, T: int) -> list[PipelineStage]:
        """This rank's stages for microbatches of `m` rows of `T` tokens (this rank's part of the
        sequence under context parallelism), each told what it receives and sends: tokens (m, T)
        into the first, hidden states (m, T / sequence split, dim) between stages (wider where the
        model sends more along, `stage_widths`), the loss (0-dim) out of the last. Given both, the
        library builds its buffers from them instead of running every stage once on empty inputs
        to find out, a forward whose values nobody should see."""
        from torch.distributed.pipelining import PipelineStage  # see _schedule

        def hidden(width: int) -> torch.Tensor:  # its gradient travels back
            return torch.empty(m, T // self.sequence_split, width, dtype=self.hidden_dtype, device="meta",
                               requires_grad=True)

        tokens, loss = torch.empty(m, T, dtype=torch.int64, device="meta"), torch.empty((), device="meta")
        widths = [part.stage_widths() for part in self.parts]  # (received, sent): dim, or more (Gemma 4)
        return [PipelineStage(part, s, self.n_stages, self.device, input_args=tokens if s == 0 else hidden(w_in),
                              output_args=loss if s == self.n_stages - 1 else hidden(w_out), group=self.group)
                for part, s, (w_in, w_out) in zip(self.parts, self.stage_ids, widths)]

    def _schedule_for(self, local_batch: int, T: int, n_batches: int,
                      loss_fn: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]):
        """The schedule for sequences of T tokens, built at the first step that has them (its
        stages' buffers have their shapes; a length schedule gets one per length)."""
        n, source = microbatches(self.cfg, local_batch, local_batch // n_batches)
        if self._shape is None:
            error = microbatch_error(self.cfg.pp_schedule, self.cfg.pp, n, local_batch, source)
            if error:
                raise ForjaError(error)
            self._shape = (local_batch, n)
        elif self._shape != (local_batch, n):
            raise ForjaError(f"the pipeline was set up for {self._shape[1]} microbatches of a local batch of "
                             f"{self._shape[0]} sequences, and cannot change within a run; got {n} of {local_batch}")
        if T not in self._schedules:
            stages = self._stages(local_batch // n, T)
            # The last stage's forward already returns the microbatch's loss (labels are
            # among its inputs); the schedule's target, the microbatch's labels, tells how
            # many of them it trains on (padding).
            self._schedules[T] = _schedule(self.cfg.pp_schedule)(
                stages if len(stages) > 1 else stages[0], n_microbatches=n,
                loss_fn=lambda out, target: loss_fn(out, n, target), scale_grads=False)
        return self._schedules[T]

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None, *,
             n_batches: int, loss_fn: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor],
             cp_rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forwards and backwards of this rank's stages over the local batch, tokens and
        labels (local batch, T), accumulating gradients in the parts. `loss_fn(out, n, labels)`
        turns the last stage's output for one of n microbatches (and its labels) into what that
        microbatch adds to the step's loss. Returns those losses on the last stage's rank, [] elsewhere.
        Under context parallelism tokens and labels are this rank's part of each row and
        `cp_rows` (local batch, T) the whole rows' documents (forja/parallel/cp `stage_hook`)."""
        schedule = self._schedule_for(tokens.shape[0], tokens.shape[1], n_batches, loss_fn)
        kwargs = {"labels": labels}  # every stage's forward gets its microbatch's slice
        if document_ids is not None:
            kwargs["document_ids"] = document_ids
        if self.parts[0].stages_read_tokens:  # blocks that route by token id (DeepSeek-V4's hash layers)
            kwargs["token_ids"] = tokens
        if cp_rows is not None:
            kwargs["cp_rows"] = cp_rows
        args = (tokens,) if self.has_first else ()
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        schedule.step(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False,
                      **kwargs)
        return losses or []

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """`value` as the last stage's rank holds it, on every pp rank (the others pass zeros)."""
        dist.all_reduce(value, group=self.group)
        return value

    # -- forward only ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None,
                document_ids: torch.Tensor | None) -> torch.Tensor | None:
        """One micro-batch through the stages in order: the last stage's output (the loss, or
        without labels the logits) on the rank holding it, None elsewhere."""
        out = h = None
        for part, s in zip(self.parts, self.stage_ids):
            if s == 0:
                x = tokens  # (m, T)
            elif self.owners[s - 1] != self.pp_rank:
                x = self._recv(self.owners[s - 1])  # (m, T, dim): hidden states
            else:
                x = h  # the previous stage ran here (the bottom of a V)
            ids = {"token_ids": tokens} if part.stages_read_tokens else {}
            h = part(x, document_ids=document_ids, labels=labels, **ids)  # hidden states: the only positional input
            if s == self.n_stages - 1:
                out = h
            elif self.owners[s + 1] != self.pp_rank:
                self._send(h, self.owners[s + 1])
        return out

    # A header (dtype code, ndim, shape...) goes before each hidden state: its shape
    # depends on the layout (sequence parallelism splits T) and its dtype on autocast.
    _DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    _HEADER = 6

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, h: torch.Tensor, pp_rank: int) -> None:
        h = h.contiguous()
        header = [self._DTYPES.index(h.dtype), h.dim(), *h.shape]
        header += [0] * (self._HEADER - len(header))
        dist.send(torch.tensor(header, dtype=torch.int64, device=h.device), self._peer(pp_rank), group=self.group)
        dist.send(h, self._peer(pp_rank), group=self.group)

    def _recv(self, pp_rank: int) -> torch.Tensor:
        header = torch.zeros(self._HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, self._peer(pp_rank), group=self.group)
        code, ndim, *shape = header.tolist()
        h = torch.empty(shape[:ndim], dtype=self._DTYPES[code], device=self.device)
        dist.recv(h, self._peer(pp_rank), group=self.group)
        return h


def build_pipeline(model: Transformer, *, dims: ParallelDims, cfg: ParallelConfig, device: torch.device,
                   prepare: Callable[[Transformer], None], seq_len: int = 0) -> Pipeline:
    """This rank's stages of `model` (whole, on the meta device), each prepared by
    `prepare` (parallelized and materialized), in the `Pipeline` that runs them. The layout
    was checked by the validator (forja/parallel/checks.py) before anything was built."""
    counts = layers_per_stage(model, pp=dims.pp, schedule=cfg.pp_schedule, pp_layers=cfg.pp_layers,
                              seq_len=seq_len)
    stage_ids = rank_stages(dims.pp_mesh.get_local_rank(), dims.pp, cfg.pp_schedule)
    parts = []
    for s in stage_ids:
        part = stage_part(model, s, counts)
        prepare(part)
        parts.append(part)
    return Pipeline(parts, stage_ids, cfg=cfg, dims=dims, device=device)
