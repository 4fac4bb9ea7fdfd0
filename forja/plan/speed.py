"""Step time of one layout: compute from counted FLOPs at an achievable fraction of the
device's peak, each collective's bytes over the link it crosses, what overlaps, and the
pipeline bubble. Formulas in docs/planner.md.

Links: the mesh is (pp, dp_replicate, dp_shard, cp, tp) with tp innermost (MESH_AXES), as
ParallelDims builds it, so a group of n ranks whose members are `stride` ranks apart stays in
one node when n x stride <= gpus_per_node; otherwise its ring crosses the network, where each
GPU has its own NIC (inter_node_bytes_per_s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from forja.models.common.moe import MoEArgs
from forja.parallel.degrees import MESH_AXES, Axis
from forja.plan.activations import alternate_recomputed
from forja.plan.context_parallel import (
    NO_MIXER,
    SCANNED,
    a2a_elements,
    act_bytes,
    compressed_block,
    compressed_gathers,
    indexer_gathers,
    indexer_target_bytes,
    ring_attention_work,
    ring_kv_bytes,
    ring_scan_bytes,
)
from forja.plan.hardware import Hardware
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import Breakdown, end_ranks, rank_elements

# Every constant below comes from a datasheet or a published microbenchmark, never from the
# training runs the model is validated against (bench/plan_published.py); docs/planner.md
# ("Calibration") lists each with its source. bench/calibrate.py measures the same figures
# on a GPU machine; until it has run on one, these stand.
#
# Achieved / peak of a large bf16 matmul: Stas Bekman's "Maximum Achievable Matmul FLOPS"
# table (stas00/ml-engineering, compute/accelerator/README.md, mamf-finder.py): H100 SXM
# 792.1 of 989 TFLOP/s (80.1%, CUDA 12.1), A100 SXM 267.9 of 312 (85.9%), MI300X 781.9 of
# 1300 (60.1%, ROCm 6.2), GH200 821 of 989 (83.0%). Kinds the table lacks take H100's figure.
GEMM_EFFICIENCY = {"h100": 0.801, "h100-pcie": 0.801, "h200": 0.830, "a100": 0.859, "a100-40gb": 0.859,
                   "mi300x": 0.601}
DEFAULT_GEMM_EFFICIENCY = 0.801
# Rows (or columns) at which a matmul runs at half its large-size rate: Hopper's and Ampere's
# cuBLAS/CUTLASS bf16 kernels compute 128-wide output tiles, so a dimension of 128 fills one
# tile per SM wave at best (wave quantization; mamf-finder's shape sweeps show the fall-off).
HALF_RATE_SIZE = 128
# Attention (FlashAttention-2 class kernels, as PyTorch's SDPA runs on Hopper): the
# FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608) reports FA3 at up to 740 TFLOP/s
# (75% of H100's peak) and 1.5-2.0x FA2, i.e. FA2 at 37-50% forward; its backward is slower.
# 0.35 of peak on the causal FLOPs (half of the full-score count forja reports), forward and
# backward together.
ATTENTION_EFFICIENCY = 0.35
# Memory-bound kernels (norms, RoPE, activations, residual adds, casts, the loss) stream at
# this fraction of the datasheet HBM bandwidth: an assumption (copy kernels typically reach
# ~90%), to be replaced by bench/calibrate.py's copy measurement.
HBM_EFFICIENCY = 0.9
# float8 Linear layers (torchao): the matmul at the fp8 peak with the bf16 efficiency (no
# published fp8 MAMF for H100 was found), plus the casts' memory traffic (`_float8_cast_bytes`).
# CPU offload: one GPU's share of its host's memory bandwidth, and PCIe Gen4/5 x16 one-way
# (32 / 64 GB/s datasheet) at about 80%, shared by two GPUs per switch in HGX boards.
HOST_BYTES_PER_S = 12e9
PCIE_BYTES_PER_S = 25e9


@dataclass
class TimeBreakdown(Breakdown):
    """Seconds of one optimizer step on the slowest rank."""

    compute: float = 0.0
    """Forward + backward (+ recomputation) at the achievable FLOP rate."""
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0
    fsdp_comm_exposed: float = 0.0
    """FSDP all-gathers and reduce-scatters (and HSDP's all-reduce) not hidden behind compute."""
    pp_bubble: float = 0.0
    pp_comm: float = 0.0
    offload: float = 0.0
    """CPU offload: the optimizer step on the host and the PCIe copies."""


def link_bandwidth(hw: Hardware, lay: Layout, dim: Axis) -> float:
    """Bytes/s per rank of a collective over mesh dimension `dim`."""
    inner = MESH_AXES[MESH_AXES.index(dim) + 1:]  # the dimensions nearer the ranks: `dim`'s stride
    stride = 1
    for _, degree in lay.degrees.items(inner):
        stride *= degree
    size = lay.degrees[dim]
    return hw.intra_node_bytes_per_s if size * stride <= hw.gpus_per_node else hw.inter_node_bytes_per_s


def ring_time(bytes_: float, n: int, bw: float, *, all_reduce: bool = False) -> float:
    """All-gather / reduce-scatter (all-reduce: twice) of `bytes_` (the whole tensor) over n ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (n - 1) / n * bytes_ / bw


def all_to_all_time(bytes_: float, n: int, hw: Hardware, stride: int) -> float:
    """An all-to-all of `bytes_` per rank over n ranks `stride` apart: the share bound for
    peers in this node crosses NVLink, the rest the GPU's NIC, both at once."""
    if n <= 1:
        return 0.0
    in_node = max(1, min(n, hw.gpus_per_node // max(1, stride)))
    intra = (in_node - 1) / n * bytes_ / hw.intra_node_bytes_per_s
    inter = (n - in_node) / n * bytes_ / hw.inter_node_bytes_per_s
    return max(intra, inter)


def peak_flops(job: Job, hw: Hardware) -> float:
    return hw.bf16_flops if job.bf16 else hw.fp32_flops


def gemm_efficiency(hw: Hardware) -> float:
    return GEMM_EFFICIENCY.get(hw.kind, DEFAULT_GEMM_EFFICIENCY)


def matmul_efficiency(rows: float, width: float, hw: Hardware | None = None) -> float:
    """The achievable fraction of peak for matmuls of `rows` tokens and `width` columns per
    rank: a large matmul's measured fraction, less where tiles of a small one leave the GPU's
    units idle (a dimension of 128 runs at about half the large-size rate)."""
    large = gemm_efficiency(hw) if hw is not None else DEFAULT_GEMM_EFFICIENCY
    return large * rows / (rows + HALF_RATE_SIZE) * width / (width + HALF_RATE_SIZE)


def routed_expert_flops(job: Job, block) -> float:
    """Training FLOPs per token of a block's routed experts (6 x the top-k experts' weights)."""
    a = job.args
    if not (block.moe and isinstance(a, MoEArgs) and a.n_experts):
        return 0.0
    return 6.0 * block.experts * a.top_k / a.n_experts


def expert_gemm_factor(job: Job, lay: Layout, tokens_mb: float, block) -> float:
    """The routed experts' matmul rate over the block's dense one: each expert's GEMM has only
    the tokens routed to it as rows (top_k x the rank's tokens spread over n_experts / ep local
    experts, evenly routed) and the narrower of moe_ffn_dim and the experts' width (the model's,
    or latent experts' `expert_width`) as its narrow side, so small experts fill few tiles
    (the same wave-quantization factor as any matmul, HALF_RATE_SIZE)."""
    a = job.args
    if not (isinstance(a, MoEArgs) and a.n_experts and a.moe_ffn_dim):
        return 1.0
    rows = tokens_mb / lay.tp * a.top_k * lay.ep / a.n_experts  # under TP a rank routes 1/tp of the tokens
    dense = matmul_efficiency(tokens_mb, min(a.dim, a.n_heads * a.head_dim / lay.tp))
    return matmul_efficiency(rows, min(block.expert_width or a.dim, a.moe_ffn_dim)) / dense


def recompute_factor(lay: Layout) -> float:
    """Block FLOPs with recomputation: full AC reruns the forward (1/3 of 6N more)."""
    if lay.ac == "full":
        return 4 / 3
    if lay.ac == "selective" and lay.ac_every:
        return 1 + 1 / (3 * lay.ac_every)
    return 1.0  # op level: only elementwise ops rerun (their traffic is in elementwise_bytes)


def elementwise_bytes(job: Job, lay: Layout, block) -> float:
    """HBM bytes per token of one block's memory-bound kernels, forward and backward (and the
    recomputed forward under AC): pre-norms, residual adds, RoPE, the gated activation, an
    MoE layer's token shuffles. Eager PyTorch runs each op as its own kernel (RMSNorm: cast,
    square-mean, scale, weight: ~4 passes); torch.compile, or forja's fused Triton kernels, make
    each group one pass. Backward reads the saved inputs and the gradient and writes one: ~2x."""
    a = job.args
    lin, res = (2 if job.bf16 else 4), (2 if job.bf16_params else 4)
    sp = lay.sp_degree
    q, kv = a.n_heads * a.head_dim / lay.tp, a.n_kv_heads * a.head_dim / lay.tp
    if block.moe:  # under TP each rank runs the MoE layer for its 1/tp of the tokens
        f = (a.top_k * a.moe_ffn_dim + a.shared_width) / lay.tp
    else:
        f = a.ffn_dim / lay.tp
    norm_fused = job.compiled or "rms_norm" in job.fused or block.layer_norm
    act_fused = job.compiled or "swiglu" in job.fused
    norms = 2 * a.dim * (res + lin if norm_fused else 4 * res + lin) / sp
    adds = 2 * 3 * a.dim * res / sp
    rope = (2 if job.compiled or "rope" in job.fused else 6) * (q + kv) * lin
    act = (3 if act_fused else 5) * f * lin if block.gated else (2 if act_fused else 4) * f * lin
    # permute in, unpermute, weight, combine: rows of the experts' width (latent experts' is narrower)
    shuffle = 4 * a.top_k * (block.expert_width or a.dim) * lin / lay.tp if block.moe else 0.0
    forward = norms + adds + rope + act + shuffle
    rerun = 1.0 if lay.ac in ("full", "selective") and not lay.ac_every else (1 / lay.ac_every if lay.ac_every else 0)
    return forward * (3 + rerun)


def loss_bytes(job: Job, lay: Layout) -> float:
    """HBM bytes per token of the loss: log-softmax and its backward pass over the fp32 logits
    a few times (write, read for the max and sum, gradient written and read by the matmul)."""
    return 5 * 4 * job.args.vocab_size / lay.tp


def float8_cast_bytes(job: Job, lay: Layout, block, tokens_mb: float) -> float:
    """HBM bytes per token of torchao's float8 casts (tensorwise): each Linear's input is read
    for its amax and again to write its fp8 copy (forward), and the output gradient the same
    (backward); the weights are cast once per micro-batch (amortized over its tokens)."""
    a = job.args
    inputs = 4 * a.dim + (a.ffn_dim / lay.tp if not block.moe else 0) + a.n_heads * a.head_dim / lay.tp
    per_token = 2 * inputs * (2 + 2 + 1)  # read for amax, read + write fp8 (1 byte), forward and backward
    weights = (block.tp_split / lay.tp + block.replicated) * (2 + 2 + 1) * 2 / max(tokens_mb, 1.0)
    return per_token + weights


def predict_time(job: Job, lay: Layout, hw: Hardware) -> TimeBreakdown:
    """The step time of the slowest pipeline rank (inf on a device of unknown peak)."""
    if not hw.peak_known:
        return TimeBreakdown(compute=math.inf)
    return max((_rank_time(job, lay, hw, rm) for rm in end_ranks(job, lay)), key=lambda t: t.total)


def _compute_time(job: Job, lay: Layout, hw: Hardware, rm, tokens_mb: float, tokens: float) -> tuple[float, float]:
    """(seconds of compute on this rank per step, of which matmuls feeding TP collectives)."""
    a = job.args
    peak = peak_flops(job, hw)
    rate = peak * matmul_efficiency(tokens_mb, min(a.dim, a.n_heads * a.head_dim / lay.tp), hw)
    fp8 = job.float8 and hw.fp8_flops > 0
    linear_rate = rate * (hw.fp8_flops / peak if fp8 else 1.0)
    attn_rate = attention_rate(job, hw)
    hbm = hw.hbm_bytes_per_s * HBM_EFFICIENCY
    linear = attn = memory = 0.0
    ring = ring_attention_seconds(job, lay, hw) if lay.cp > 1 and lay.cp_kind == "ring" else None
    for b, idx in rm.groups:
        n, attention, routed = len(idx), attention_flops(job, b), routed_expert_flops(job, b)
        expert_rate = linear_rate * expert_gemm_factor(job, lay, tokens_mb, b) if routed else linear_rate
        dense = (b.flops_per_token - attention - routed) / linear_rate + routed / expert_rate
        linear += n * dense * recompute_factor(lay) / lay.tp
        if lay.op_level_alternate:  # the matmuls it recomputes, their forward again (per rank already)
            linear += n * (alternate_recomputed(job, lay, b) or (0.0, 0.0))[1] / linear_rate
        if ring and attention and not compressed_block(job, b):  # forja's ring blocks (per micro-batch -> token)
            attn += n * (ring[0] * (1 + forward_reruns(lay)) + ring[1]) / tokens_mb
        else:
            attn += n * attention * masked_tiles(job, b) * recompute_factor(lay) / lay.tp / attn_rate
        memory += n * (elementwise_bytes(job, lay, b) + (float8_cast_bytes(job, lay, b, tokens_mb) if fp8 else 0.0))
    out = job.shape.output_flops_per_token / lay.tp / linear_rate if rm.last else 0.0
    memory += loss_bytes(job, lay) if rm.last else 0.0
    return tokens * (linear + attn + out + memory / hbm), tokens * linear


def _rank_time(job: Job, lay: Layout, hw: Hardware, rm) -> TimeBreakdown:
    a = job.args
    micro = lay.microbatches(job.global_batch_size)
    tokens_mb = lay.sequences_per_microbatch(job.global_batch_size) * job.seq_len / lay.cp  # per micro-batch
    tokens = tokens_mb * micro
    compute, tp_matmuls = _compute_time(job, lay, hw, rm, tokens_mb, tokens)
    t = TimeBreakdown(compute=compute)
    act = 2 if job.bf16 else 4
    n_blocks = sum(len(idx) for _, idx in rm.groups)
    if lay.tp > 1:  # per block: 2 gathers + 2 reduce-scatters forward, the same backward (+ recompute)
        ops = 8 + (4 if lay.ac == "full" else 0)
        per_op = ring_time(tokens_mb * a.dim * act, lay.tp, link_bandwidth(hw, lay, Axis.TP))
        comm = ops * per_op * n_blocks * micro
        # Async TP splits each collective into tp chunks run under the matmul of the chunk
        # before: what shows is the first chunk and whatever the matmuls cannot cover.
        t.tp_comm = comm / lay.tp + max(0.0, comm * (1 - 1 / lay.tp) - tp_matmuls) if job.async_tp else comm
    t.cp_comm = micro * sum(len(idx) * cp_block_time(job, lay, hw, b, tokens_mb) for b, idx in rm.groups)
    moe_blocks = sum(len(idx) for b, idx in rm.groups if b.moe)
    if lay.ep > 1 and moe_blocks:  # dispatch and combine, forward and backward
        volume = (a.top_k if isinstance(a, MoEArgs) else 1) * tokens_mb * a.dim * act
        t.ep_comm = 4 * moe_blocks * micro * all_to_all_time(volume, lay.ep, hw, lay.tp * lay.cp)
    t.fsdp_comm_exposed = _fsdp_exposed(job, lay, hw, rm, compute)
    t.offload = offload_time(job, lay, rm)
    if lay.pp > 1:
        t.pp_bubble = compute * bubble_fraction(lay, micro)
        width = job.shape.stage_width or a.dim  # what a stage hands on a token (DeepSeek-V4: hc_mult x dim)
        t.pp_comm = 2 * micro * tokens_mb * width * act / link_bandwidth(hw, lay, Axis.PP) * rm.stages
    return t


def attention_flops(job: Job, block) -> float:
    """Training FLOPs per token of a block's attention scores as the model reports them (12 H hd
    x the keys a query sees, full scores; the causal kernel computes half); none in a
    linear-attention block, whose scan is counted with its matmuls. DeepSeek Sparse Attention
    counts all T keys: its top-k keys are a mask over dense SDPA (forja/models/common/sparse_attention.py),
    whose kernel computes every tile, masked or not (`masked_tiles`)."""
    a = job.args
    if block.kind in ("linear_attention", "mamba2", "mlp", "moe"):  # a scan counted with its matmuls; no mixer
        return 0.0
    span = {"sliding_attention": getattr(a, "sliding_window", None),
            "chunked_attention": getattr(a, "attention_chunk_size", None)}.get(block.kind)  # a window or a chunk
    keys = job.seq_len if span is None else min(job.seq_len, span)
    return 12 * a.n_heads * a.head_dim * keys


def masked_tiles(job: Job, block) -> float:
    """1 where attention runs causal (the kernel skips the upper half, `attention_rate`), 2 where a
    DeepSeek Sparse Attention block's selection mask makes it compute every tile (rows longer than
    top-k; not in the dense warm-up, which runs causal)."""
    indexer = getattr(block, "indexer", ())
    return 2.0 if indexer and indexer[3] != 1 and job.seq_len > indexer[2] else 1.0


def attention_rate(job: Job, hw: Hardware) -> float:
    """FLOP/s on attention_flops: half the counted FLOPs are computed (causal)."""
    return peak_flops(job, hw) * ATTENTION_EFFICIENCY * 2


def cp_block_time(job: Job, lay: Layout, hw: Hardware, block, tokens_mb: float) -> float:
    """Seconds of one block's context-parallel communication on the critical path, per
    micro-batch (forward, backward, and the forward again where AC recomputes the block).

    all-to-all: four all-to-alls forward, four backward, none hidden. ring: each hop's K, V
    (dK, dV with them in backward) go under the attention blocks of the hop, 1/cp of the
    rank's (causal masking skips the hidden blocks, the load-balanced chunks even the rest);
    what a hop's transfer takes beyond that shows, and the last dK, dV hop home. A recurrent
    block (Gated DeltaNet, Kimi Delta Attention, Mamba-2) under ring all-gathers its state
    transitions and sends its halo instead; a block without a sequence mixer moves nothing.
    DeepSeek-V4's blocks, under either kind, all-gather the halos and entries their chunks
    need (context_parallel.py `compressed_gathers`), none hidden."""
    if lay.cp == 1 or block.kind in NO_MIXER:
        return 0.0
    reruns = forward_reruns(lay)
    if compressed_block(job, block):  # DeepSeek-V4, either kind: its gathers with every forward, a sum back
        gathered, summed = compressed_gathers(job, lay, block, tokens_mb)
        bw = link_bandwidth(hw, lay, Axis.CP)
        return (1 + reruns) * ring_time(gathered, lay.cp, bw) + ring_time(summed, lay.cp, bw, all_reduce=True)
    indexer = indexer_cp_time(job, lay, hw, block, tokens_mb)
    if lay.cp_kind == "all-to-all":
        volume = tokens_mb * a2a_elements(job, lay, block) * act_bytes(job)
        return (2 + reruns) * all_to_all_time(volume, lay.cp, hw, lay.tp) + indexer
    bw = link_bandwidth(hw, lay, Axis.CP)
    if block.kind in SCANNED:
        state, halo = ring_scan_bytes(job, lay, block, lay.sequences_per_microbatch(job.global_batch_size))
        return (2 + reruns) * (ring_time(state * lay.cp, lay.cp, bw) + halo / bw)
    kv, dkv = ring_kv_bytes(job, lay, tokens_mb)
    attention_forward, attention_backward = ring_attention_seconds(job, lay, hw)  # each hop 1/cp of them
    hops = lay.cp - 1
    forward = hops * max(0.0, kv / bw - attention_forward / lay.cp)
    backward = hops * max(0.0, (kv + dkv) / bw - attention_backward / lay.cp) + dkv / bw
    return (1 + reruns) * forward + backward + indexer


def indexer_cp_time(job: Job, lay: Layout, hw: Hardware, block, tokens_mb: float) -> float:
    """Seconds of a DeepSeek Sparse Attention block's indexer traffic under CP per micro-batch
    (context_parallel.py `indexer_gathers`, `indexer_target_bytes`), none hidden: the gathers
    and the target with every forward (AC's again too), the keys' gradient summed in backward.
    Ring's second pass of K is counted whole, though each hop runs beside its blocks."""
    gathered, summed = indexer_gathers(job, lay, block, tokens_mb)
    target = indexer_target_bytes(job, lay, block, tokens_mb)
    if not (gathered or target):
        return 0.0
    bw = link_bandwidth(hw, lay, Axis.CP)
    moved = all_to_all_time(target, lay.cp, hw, lay.tp) if lay.cp_kind == "all-to-all" else target / bw
    forward = ring_time(gathered, lay.cp, bw) + moved
    return (1 + forward_reruns(lay)) * forward + ring_time(summed, lay.cp, bw, all_reduce=True)


def forward_reruns(lay: Layout) -> float:
    """Forwards AC runs again per block: 1 under full AC, 1/k checkpointing every k-th block."""
    return 3 * (recompute_factor(lay) - 1)


def ring_attention_seconds(job: Job, lay: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of one attention block under forja's ring, per micro-batch on
    one rank: its blocks' fp32 matmuls at the fp32 GEMM rate, then their score passes at the
    memory's (forja/plan/context_parallel.py: no fused kernel yet)."""
    flops, traffic = ring_attention_work(job, lay, lay.sequences_per_microbatch(job.global_batch_size))
    rate, hbm = hw.fp32_flops * gemm_efficiency(hw), hw.hbm_bytes_per_s * HBM_EFFICIENCY
    return flops[0] / rate + traffic[0] / hbm, flops[1] / rate + traffic[1] / hbm


def bubble_fraction(lay: Layout, micro: int) -> float:
    """Idle time over busy time of a pipeline: (p - 1) / m for GPipe and 1F1B, divided by
    the stages per rank for interleaved; zero-bubble schedules fill most of it."""
    p, m, v = lay.pp, micro, lay.stages_per_rank
    if lay.pp_schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if lay.pp_schedule == "interleaved-1f1b":
        return (p - 1) / (m * v)
    return (p - 1) / (3 * m * v)  # zero-bubble / dualpipev: what the split backward cannot fill


def _fsdp_exposed(job: Job, lay: Layout, hw: Hardware, rm, compute: float) -> float:
    """FSDP's all-gathers (forward; again in backward under ZeRO-3) and reduce-scatters run
    on their own stream, prefetched a block ahead: only what exceeds the compute shows, plus
    the first block's gather, which nothing hides."""
    root, largest, blocks, _ = rank_elements(job, lay, rm)
    elements = root + blocks
    gather_width = 2 if job.bf16_params else 4
    bw = link_bandwidth(hw, lay, Axis.DP_SHARD)
    comm = 0.0
    if lay.fsdp > 1:
        gathers = 2 if lay.reshard_after_forward else 1
        # Without a pipeline FSDP reduces every micro-batch's gradients and gathers the parameters
        # again for the next, unless parallel.grad_sync = "step" holds both until the last.
        rounds = lay.microbatches(job.global_batch_size) if lay.pp == 1 and lay.grad_sync != "step" else 1
        comm += rounds * gathers * ring_time(elements * gather_width, lay.fsdp, bw)
        comm += rounds * ring_time(elements * 4, lay.fsdp, bw)  # gradients reduced in fp32
    if lay.dp_replicate > 1:
        comm += ring_time(elements / max(1, lay.fsdp) * 4, lay.dp_replicate,
                          link_bandwidth(hw, lay, Axis.DP_REPLICATE), all_reduce=True)
    first = ring_time(largest * gather_width, lay.fsdp, bw) if lay.fsdp > 1 else 0.0
    return max(0.0, comm - compute) + first


def offload_time(job: Job, lay: Layout, rm) -> float:
    """CPU offload (FSDP's CPUOffloadPolicy): the optimizer steps on the host, after backward,
    touching parameter, gradient and both moments (read and write) at the host memory bandwidth
    a GPU's share of the socket gives; the shards also cross PCIe (to the GPU for forward and
    backward, gradients back), which prefetching hides only partly."""
    if not (lay.cpu_offload and job.gpu):
        return 0.0
    root, _, blocks, _ = rank_elements(job, lay, rm)
    shard_bytes = (root + blocks) / max(1, lay.fsdp) * 4
    return shard_bytes * (2 + 2 * job.state_per_param) * 2 / HOST_BYTES_PER_S + 3 * shard_bytes / PCIE_BYTES_PER_S


def throughput(job: Job, lay: Layout, hw: Hardware, step_time: float) -> tuple[float, float, float]:
    """(tokens/s of the whole job, per device, MFU) at `step_time`; on a device of unknown
    peak (0, 0, nan): no speed is predicted there, and MFU is "unknown peak", not a guess."""
    if not hw.peak_known:
        return 0.0, 0.0, math.nan
    tokens = job.tokens_per_step / step_time
    per_device = tokens / lay.world_size
    flops = job.shape.flops_per_token * per_device
    return tokens, per_device, flops / peak_flops(job, hw)
