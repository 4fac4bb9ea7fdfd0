"""The one layout validator: whether forja can run a layout, and every reason it cannot.

    errors = layout_errors(LayoutRequest(args=..., parallel=..., world_size=..., ...))
    check_layout(request)   # raises ForjaError with the reasons, for forja train

`forja train`'s preflight (before anything is written, and in the launcher before torchrun
starts), `parallel.auto`, the memory check's suggestions and `forja plan`'s search all ask
this module and nothing else, so a layout the planner ranks is a layout train accepts; each
builds its request in one place, `forja.plan.planner.layout_request` (from the planner's `Job`,
which `job_from_config` reads off the run's config: one replica group's batch, every length).
Each reason names the keys involved and a fix: a bad layout costs seconds, not a cluster
allocation. Nothing here builds a model or touches a device: the checks are arithmetic on
the model's args, the degrees and the run's settings, cheap enough for a search over
thousands of layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from forja.errors import ForjaError
from forja.models.common.moe import MoEArgs
from forja.models.common.transformer import TransformerArgs
from forja.parallel.config import ParallelConfig
from forja.parallel.degrees import Axis
from forja.parallel.dims import ParallelDims
from forja.parallel.pp import check_pipeline


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    """A layout as a run would launch it: the model, the `[parallel]` section (degrees and
    options), the world it runs on and the settings of the run the checks read."""

    args: TransformerArgs
    parallel: ParallelConfig
    world_size: int
    seq_len: int
    global_batch_size: int
    """Sequences per step over the data-parallel ranks: the whole global batch, or under [ft]
    one replica group's share of it."""
    micro_batch_size: int
    device_type: str = "cpu"
    """"cuda" or "cpu": the kind of device the ranks run on (the planner passes its hardware's)."""
    document_mask: bool = False
    float8: str = "none"
    precision: str = "auto"
    seq_lens: tuple[int, ...] = ()
    """Every sequence length the run trains at (train.seq_len_schedule, data stages), each
    checked as seq_len is; empty: seq_len alone."""
    qk_clip_tau: float = 0.0
    """optim.qk_clip_tau: > 0 clips attention weights by each head's max logit over the step."""
    max_logit_metric: bool = False
    """optim.max_logit_metric: each head's max logit recomputed and logged."""
    ft: bool = False
    """The run's replicas are torchft replica groups ([ft]); global_batch_size is then one
    group's share."""
    check_interval: int = 0
    """ft.check_interval: every this many steps, replicas compare their weights."""
    ft_replicas: int = 1
    """[ft] replica groups holding the same weights after every step (hsdp's; DiLoCo's differ)."""


Check = Callable[[LayoutRequest, ParallelDims], None]


def _divides(a: int, b: int, what: str, fix: str) -> None:
    if b % a:
        raise ForjaError(f"{what} is not divisible by {a}; {fix}")


def _check_tp(r: LayoutRequest, dims: ParallelDims) -> None:
    args, tp = r.args, dims.tp
    if tp > 1:
        fix = "choose a parallel.tp that divides it, or change the model (model.overrides)"
        for field, count in args.split_counts().items():
            _divides(tp, count, f"model {field} = {count} (parallel.tp = {tp})", fix)


def _check_vocab(r: LayoutRequest, dims: ParallelDims) -> None:
    if dims.tp > 1:
        _divides(dims.tp, r.args.vocab_size, f"vocab_size = {r.args.vocab_size} (parallel.tp = {dims.tp})",
                 "pad it with model.overrides.vocab_size (a multiple of 64 or 128 is also faster)")


def _check_sequence_parallel(r: LayoutRequest, dims: ParallelDims) -> None:
    tp, cfg, seq_len = dims.tp, r.parallel, r.seq_len
    if tp > 1:
        if cfg.sequence_parallel:
            _divides(tp, seq_len, f"train.seq_len = {seq_len} (parallel.tp = {tp} with sequence parallelism)",
                     "change train.seq_len or set parallel.sequence_parallel = false")
        if cfg.async_tp and r.device_type != "cuda":
            raise ForjaError("parallel.async_tp needs CUDA (symmetric memory); set it to false on CPU")
        if cfg.async_tp and not cfg.compile:
            raise ForjaError("parallel.async_tp works through torch.compile's micro-pipelining; "
                             "set parallel.compile = true as well")


def _check_float8(r: LayoutRequest, dims: ParallelDims) -> None:
    tp, float8 = dims.tp, r.float8
    if tp > 1:
        if float8 not in ("none", "tensorwise"):
            raise ForjaError(f"train.float8 = '{float8}' with parallel.tp > 1 is not supported (torchao's float8 "
                             "tensor-parallel styles scale tensorwise); set train.float8 = 'tensorwise', or "
                             "parallel.tp = 1")


def _n_experts(args: TransformerArgs) -> int:
    return args.n_experts if isinstance(args, MoEArgs) else 0


def _check_ep(r: LayoutRequest, dims: ParallelDims) -> None:
    if dims.ep == 1:
        return
    n_experts = _n_experts(r.args)
    if n_experts == 0:
        raise ForjaError(f"parallel.ep = {dims.ep} needs a mixture-of-experts model, but this model has no "
                         "experts; set parallel.ep = 1 or choose an MoE flavor (e.g. qwen3 debug-moe)")
    _divides(dims.ep, n_experts, f"model n_experts = {n_experts} (parallel.ep = {dims.ep})",
             "choose a parallel.ep that divides the number of experts")


def _check_moe_tp(r: LayoutRequest, dims: ParallelDims) -> None:
    """Under TP each rank computes an MoE layer on its slice of the sequence and holds
    n_experts / (ep x tp) of the routed experts (forja/parallel/ep.py `expert_layout`)."""
    n_experts = _n_experts(r.args)
    if dims.tp == 1 or n_experts == 0:
        return
    ranks = dims.ep * dims.tp
    _divides(ranks, n_experts, f"model n_experts = {n_experts} (parallel.ep x parallel.tp = {ranks}, the ranks "
             "sharing the routed experts)", "choose parallel.ep and parallel.tp whose product divides it")
    _divides(dims.tp, r.seq_len, f"train.seq_len = {r.seq_len} (parallel.tp = {dims.tp}, whose ranks split each "
             "mixture-of-experts layer's sequence)", "change train.seq_len or parallel.tp")


def _check_cp(r: LayoutRequest, dims: ParallelDims) -> None:
    """The row splits into cp chunks (all-to-all) or 2 cp (ring: a chunk and its mirror)."""
    if dims.cp == 1:
        return
    kind = r.parallel.cp_kind
    chunks, why = (2 * dims.cp, "2 x parallel.cp, a chunk and its mirror per rank") if kind == "ring" else (
        dims.cp, "parallel.cp, a chunk per rank")
    _divides(chunks, r.seq_len, f"train.seq_len = {r.seq_len} ({why} = {chunks}, under parallel.cp_kind = "
             f"'{kind}')", "change train.seq_len or parallel.cp")


def _check_batch(r: LayoutRequest, dims: ParallelDims) -> None:
    local = r.global_batch_size // max(1, dims.dp)
    if r.global_batch_size % dims.dp:
        raise ForjaError(f"train.global_batch_size = {r.global_batch_size} is not divisible by the data-parallel "
                         f"degree {dims.dp} (dp_replicate x dp_shard); change one of them")
    if local % r.micro_batch_size:
        raise ForjaError(f"train.global_batch_size / data-parallel degree = {local} is not divisible by "
                         f"train.micro_batch_size = {r.micro_batch_size}; change one of them")


# What each axis does to a model, for a refusal naming what of it cannot take that yet.
_AXIS_DOES = {"tp": "splits each block's weights over ranks", "cp": "splits each sequence over ranks",
              "pp": "cuts the model into pipeline stages"}


def _check_model_limits(r: LayoutRequest, dims: ParallelDims) -> None:
    """The axes the model's own blocks cannot take yet (its args' `layout_limits`)."""
    limits = r.args.layout_limits()
    if r.document_mask and "documents" in limits:
        raise ForjaError(f"model.document_mask = true keeps attention within each packed document, which "
                         f"{limits['documents']} do not support yet; set model.document_mask = false")
    if r.document_mask and dims.cp > 1 and "cp_documents" in limits:
        raise ForjaError(f"model.document_mask = true with parallel.cp = {dims.cp} keeps each packed document "
                         f"apart across ranks, which {limits['cp_documents']} do not support yet; set "
                         "model.document_mask = false or parallel.cp = 1")
    for axis, degree in (("tp", dims.tp), ("cp", dims.cp), ("pp", dims.pp)):
        if degree > 1 and axis in limits:
            raise ForjaError(f"parallel.{axis} = {degree} {_AXIS_DOES[axis]}, which {limits[axis]} do not support "
                             f"yet; set parallel.{axis} = 1")


def _check_pipeline(r: LayoutRequest, dims: ParallelDims) -> None:
    check_pipeline(r.args, dims, r.parallel, device_type=r.device_type, global_batch_size=r.global_batch_size,
                   micro_batch_size=r.micro_batch_size)


def _check_precision(r: LayoutRequest, dims: ParallelDims) -> None:
    """What fp16 does not combine with: one run has one compute precision, and float8's scaled
    matmuls are made for bf16 (fp16's range would need a second scaling scheme inside theirs)."""
    if r.precision != "fp16":
        return
    if r.parallel.mixed_precision == "bf16":
        raise ForjaError("train.precision = 'fp16' computes in float16, but parallel.mixed_precision = 'bf16' "
                         "casts FSDP's parameters to bfloat16; set parallel.mixed_precision = 'fp32' (autocast "
                         "then casts to float16 per op), or train.precision = 'bf16'")
    if r.float8 != "none":
        raise ForjaError(f"train.float8 = '{r.float8}' runs its matmuls in float8 from bf16 or fp32 "
                         "activations, not under fp16 loss scaling; set train.precision = 'bf16', or "
                         "train.float8 = 'none'")


def _check_mixers(r: LayoutRequest, dims: ParallelDims) -> None:
    """What each kind of context parallelism asks of the sequence mixers: all-to-all hands
    each rank whole heads (of every mixer, per tensor-parallel shard); ring hands a recurrent
    mixer's short convolution the K - 1 inputs before a chunk, so a chunk must be that long."""
    if dims.cp == 1:
        return
    if r.parallel.cp_kind == "all-to-all":
        _check_head_shares(r, dims)
        return
    kinds = {r.args.layer_type(i) for i in range(r.args.n_layers)}
    chunk = r.seq_len // (2 * dims.cp)
    for kind, (field, whose) in _CONVOLUTIONS.items():
        kernel = getattr(r.args, field, 4)
        if kind in kinds and chunk < kernel - 1:
            raise ForjaError(f"train.seq_len = {r.seq_len} over 2 x parallel.cp = {2 * dims.cp} chunks leaves "
                             f"{chunk} tokens per chunk, fewer than the {kernel - 1} {whose} convolution reads "
                             "before each; raise train.seq_len or lower parallel.cp")


# The recurrent mixers' short convolutions, by kind of block: the args field of their taps, whose.
_CONVOLUTIONS = {"linear_attention": ("linear_conv_kernel", "a Gated DeltaNet's or Kimi Delta Attention's"),
                 "mamba2": ("mamba_conv_kernel", "a Mamba-2's")}
# Heads that all-to-all repeats, one per rank, where a tensor-parallel rank holds fewer than cp
# (each is read by whole heads of another count, which must divide instead): what they are.
_REPEATED = {"n_kv_heads": "key/value heads", "mamba_n_groups": "Mamba-2 groups"}


def _check_head_shares(r: LayoutRequest, dims: ParallelDims) -> None:
    cp, tp = dims.cp, dims.tp
    for name, count in r.args.head_counts().items():
        local = count // tp
        if name in _REPEATED and local and cp % local == 0:
            continue  # fewer than ranks: each is repeated to one per rank
        if local % cp:
            what = f"model {name} = {count}" + (f" / parallel.tp = {tp} = {local} per tensor-parallel rank" if tp > 1
                                                 else "")
            extra = f" (or a multiple of them: {_REPEATED[name]} are repeated)" if name in _REPEATED else ""
            raise ForjaError(f"{what} is not divisible by parallel.cp = {cp}: parallel.cp_kind = 'all-to-all' "
                             f"gives each rank whole heads; choose a parallel.cp that divides it{extra}, or "
                             "parallel.cp_kind = 'ring'")


def _check_mtp(r: LayoutRequest, dims: ParallelDims) -> None:
    """Multi-token prediction runs under data parallelism, FSDP and pipelines (on the last
    stage); it needs whole rows for the shifted tokens, and its block is not in the
    tensor-parallel or expert-parallel plans."""
    split = {axis: degree for axis, degree in dims.degrees.items((Axis.TP, Axis.CP, Axis.EP)) if degree > 1}
    if r.args.mtp_depth and split:
        name, degree = next(iter(split.items()))
        raise ForjaError(f"parallel.{name} = {degree} with multi-token prediction (model.mtp.depth = "
                         f"{r.args.mtp_depth}) is not supported yet; set parallel.{name} = 1 (data parallel, "
                         "FSDP and pipelines run it) or model.mtp.depth = 0")


def _check_max_logits(r: LayoutRequest, dims: ParallelDims) -> None:
    """A head's max logit is recomputed from the keys a rank holds (forja/models/common/max_logit.py):
    under context parallelism each rank holds part of a sequence's keys only."""
    if dims.cp > 1 and (r.qk_clip_tau > 0 or r.max_logit_metric):
        raise ForjaError("optim.qk_clip_tau / optim.max_logit_metric cannot be used with parallel.cp > 1 "
                         "(each rank sees only part of a sequence's keys); set parallel.cp = 1 or turn them off")


def _check_replica_groups(r: LayoutRequest, dims: ParallelDims) -> None:
    if r.ft and dims.dp_replicate > 1:
        raise ForjaError(f"parallel.dp_replicate = {dims.dp_replicate} with ft.enabled: the replica groups are the "
                         "replicas (HSDP's outer dimension), so set parallel.dp_replicate = 1 and ft.groups to the "
                         "number of replicas")


def _check_fingerprints(r: LayoutRequest, dims: ParallelDims) -> None:
    """ft.check_interval compares replicas that should hold the same weights: without any it would
    check nothing, silently."""
    if r.check_interval > 0 and dims.dp_replicate == 1 and r.ft_replicas == 1:
        raise ForjaError(f"ft.check_interval = {r.check_interval} compares the weights of replicas, but this layout "
                         "has none (parallel.dp_replicate = 1 and no [ft] hsdp groups): give it replicas "
                         "(parallel.dp_replicate > 1, or ft.groups > 1 with ft.mode = \"hsdp\") or set "
                         "ft.check_interval = 0")


def _check_grad_sync(r: LayoutRequest, dims: ParallelDims) -> None:
    """What reducing once a step (a distributed optimizer) asks: the gathered parameters kept
    between micro-batches (ZeRO-2), on the device, and no pipeline (whose schedule already does it)."""
    p = r.parallel
    if p.grad_sync != "step":
        return
    keeps = "parallel.grad_sync = 'step' keeps the gathered parameters and whole gradients through the step"
    if dims.pp > 1:
        raise ForjaError(f"{keeps}, which a pipeline schedule already does with parallel.pp = {dims.pp}; set "
                         "parallel.grad_sync = 'micro-batch'")
    if p.reshard_after_forward:
        raise ForjaError(f"{keeps}, so it frees none after forward: set parallel.reshard_after_forward = false "
                         "(ZeRO-2), or parallel.grad_sync = 'micro-batch'")
    if p.cpu_offload:
        raise ForjaError(f"{keeps} on the device, which parallel.cpu_offload = true moves to the host; set one "
                         "of them back (parallel.grad_sync = 'micro-batch' or parallel.cpu_offload = false)")


# Each check stops at its own first problem; the validator runs them all, so a layout with
# several problems hears of each (a planner's table shows the first).
CHECKS: tuple[Check, ...] = (_check_model_limits, _check_tp, _check_vocab, _check_sequence_parallel, _check_float8,
                             _check_ep, _check_moe_tp, _check_cp, _check_mixers, _check_batch, _check_pipeline,
                             _check_precision,
                             _check_mtp, _check_max_logits, _check_replica_groups, _check_fingerprints,
                             _check_grad_sync)


def layout_errors(r: LayoutRequest) -> list[str]:
    """Every reason forja would refuse to run `r`, each one sentence; [] when it runs."""
    try:
        dims = ParallelDims.from_config(r.parallel, r.world_size)
    except ForjaError as exc:
        return [str(exc)]  # without consistent degrees nothing else can be judged
    errors = []
    for length in r.seq_lens or (r.seq_len,):  # a schedule's every length must split as the layout needs
        at = dataclasses.replace(r, seq_len=length)
        for check in CHECKS:
            try:
                check(at, dims)
            except ForjaError as exc:
                if str(exc) not in errors:
                    errors.append(str(exc))
    return errors


def check_layout(r: LayoutRequest) -> None:
    """Raise one ForjaError holding every reason `r` is refused (nothing when it runs)."""
    errors = layout_errors(r)
    if len(errors) == 1:
        raise ForjaError(errors[0])
    if errors:
        raise ForjaError(f"this layout is refused for {len(errors)} reasons: "
                         + " ".join(f"({i}) {e}" for i, e in enumerate(errors, 1)))
