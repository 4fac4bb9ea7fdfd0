"""The parts every block's saved-activations count is built of (forja/plan/activations.py and
the families' own counts, forja/plan/gemma4_activations.py): the tensors' widths in the job's
dtypes, a pre-norm's and a post-norm's tensors, the copies the matmuls reading one input keep,
and the dense mask SDPA is handed. Apart from activations.py so that a family's count can use
them without importing the module that dispatches to it."""

from __future__ import annotations

from dataclasses import dataclass

from forja.parallel.regather import regathers
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.shape import BlockShape

FP32 = 4


@dataclass(frozen=True)
class Widths:
    """Bytes of the tensors a block saves, per token, in the job's dtypes."""

    lin: int
    """Matmul inputs/outputs: bf16 under autocast or bf16 parameters, else fp32."""
    res: int
    """Residual stream: bf16 only when the parameters themselves are bf16 (autocast keeps fp32)."""
    gathered: float = 1.0
    """The share of a sequence-gathered sublayer input its matmuls keep: 1/tp where it is
    gathered again in backward (`regathered`), else the whole sequence's."""
    float8_gathered: bool = False
    """Under float8 with sequence parallelism torchao casts a sublayer's input to float8 before
    the all-gather (PrepareFloat8ModuleInput): its matmuls keep that one-byte copy."""


def widths(job: Job) -> Widths:
    return Widths(lin=2 if job.bf16 else FP32, res=2 if job.bf16_params else FP32)


def regathered(job: Job, lay: Layout, w: Widths) -> bool:
    """Whether a block activation checkpointing leaves whole keeps its sublayers' gathered
    inputs split until backward (forja/parallel/regather.py): under sequence parallelism,
    eager or compiled by inductor, without float8, where the matmuls read the gathered tensor
    itself."""
    return w.lin == w.res and regathers(job.parallel, tp=lay.tp, sequence_parallel=lay.sequence_parallel,
                                        float8=job.float8)


def sp_share(lay: Layout) -> float:
    """The share of the sequence a rank's norms see (sequence parallelism splits it)."""
    return 1 / lay.sp_degree


def norm_saved(job: Job, lay: Layout, block: BlockShape, w: Widths, readers: int = 1) -> float:
    """Bytes per token of one pre-norm: its input, the normalized x (eager RMSNorm only: one
    kernel saves just statistics), and its output as the projections after it save it."""
    one_kernel = block.layer_norm or ("rms_norm" in job.fused and not block.zero_centered)
    normalized = 0.0 if one_kernel else (FP32 if block.zero_centered else w.res)
    return sp_share(lay) * job.args.dim * (w.res + normalized) + input_copies(job, w, readers)


def input_copies(job: Job, w: Widths, readers: int) -> float:
    """Bytes per token the `readers` matmuls reading one fp32 tensor keep of it: under
    autocast each casts it to bf16 itself and keeps its own copy (autocast caches only the
    weights' casts); otherwise they all keep the one tensor."""
    if w.float8_gathered:
        return w.gathered * job.args.dim
    return (readers if w.lin != w.res else w.gathered) * job.args.dim * w.lin


def post_norm_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> float:
    """Bytes per token of a norm on a sublayer's output (sandwich and post-norm blocks): its
    input upcast to fp32 (the input itself in fp32) and the normalized x (fp32 for a (1 + w)
    norm); nothing reads its output but the residual add."""
    if "rms_norm" in job.fused and not block.zero_centered:
        return sp_share(lay) * job.args.dim * w.lin
    return sp_share(lay) * job.args.dim * (FP32 + (FP32 if block.zero_centered else w.lin))


def sublayer_input(job: Job, lay: Layout, block: BlockShape, w: Widths, readers: int) -> float:
    """What a sublayer's first matmuls (`readers` of them) keep of their input: a pre-norm's
    tensors, or in a post-norm block the residual stream itself (their copies of it)."""
    return input_copies(job, w, readers) if block.norms == "post" else norm_saved(job, lay, block, w, readers)


def mask_saved(job: Job, lay: Layout, block: BlockShape) -> float:
    """Bytes per token of the dense mask a block's SDPA keeps (a sliding window's band, or
    packed documents'): (1 or B, 1, T, T), fp32 on CPUs and in the compute dtype on GPUs.
    FlexAttention's block mask and plain causal rows keep none."""
    flex = job.gpu and job.args.attention == "flex"
    chunked = block.kind == "chunked_attention" and job.seq_len > job.args.attention_chunk_size  # Llama 4's chunks
    if flex or (block.kind != "sliding_attention" and not chunked and not job.document_mask):
        return 0.0
    rows = 1.0 if job.document_mask else 1 / lay.sequences_per_microbatch(job.global_batch_size)
    return rows * job.seq_len * (2 if job.gpu and job.bf16 else FP32)


def routing_picks(a) -> float:
    """Bytes per token of a router's top-k picks (fp32 values, int64 indices), which op-level AC
    keeps so that a recomputed block routes as its forward did (forja/parallel/ac.py): each
    token's k experts, and with grouped routing its groups' top-2 scores and its best groups."""
    groups = getattr(a, "n_expert_groups", 1)
    groups = groups if groups > 1 else 0
    top2 = 2 if getattr(a, "group_score", "") == "top2_sum" else 0
    return (FP32 + 8) * (a.top_k + groups * top2 + (a.topk_groups if groups else 0))


def exchanged_rows(lay: Layout, slots: float, width: int, lin: int) -> float:
    """Bytes per token of what the experts' exchanges received, there and back, which op-level
    AC keeps so that backward's recompute replays them instead of communicating again
    (forja/parallel/ep.py): `slots` rows `width` wide each way, in the matmuls' dtype, when the
    experts are spread over ranks (EP, or TP's ranks as the experts' own)."""
    return 2 * slots * width * lin if lay.ep > 1 or lay.tp > 1 else 0.0
