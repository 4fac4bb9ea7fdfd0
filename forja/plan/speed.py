"""Step time of one layout: compute from counted FLOPs at an achievable fraction of the
device's peak, each collective's bytes over the link it crosses, what overlaps, and the
pipeline bubble. Formulas in docs/planner.md.

Links: the mesh is ("pp", "dp_replicate", "dp_shard", "cp", "tp") with tp innermost, as
ParallelDims builds it, so a group of n ranks whose members are `stride` ranks apart stays in
one node when n x stride <= gpus_per_node; otherwise its ring crosses the network, where each
GPU has its own NIC (inter_node_bytes_per_s).
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.plan.hardware import Hardware
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import Breakdown, end_ranks, rank_elements

# The fraction of peak a well-shaped transformer step reaches in its matmuls and attention
# (Megatron-Core's H100 runs report 41-49% MFU with every overlap on, torchtitan's 33-39%).
MATMUL_EFFICIENCY = 0.5
# CPU offload: one GPU's share of its host's memory bandwidth, and its PCIe link.
HOST_BYTES_PER_S = 12e9
PCIE_BYTES_PER_S = 25e9
# Rows (or columns) at which a matmul runs at half its large-size rate.
HALF_RATE_SIZE = 128
# float8 Linear layers: scaling and casts keep the gain over bf16 near 1.4x, not the 2x of the
# peak ratio (torchtitan's 8B: 1.28x end to end).
FLOAT8_GAIN = 1.4
# Without torch.compile every norm, activation and residual add is its own kernel reading and
# writing HBM (torchtitan's 8B: 1.16x faster compiled).
EAGER_OVERHEAD = 1.15
# Async TP overlaps part of the TP collectives with the matmuls (torchtitan: 1.09-1.16x on 70B).
ASYNC_TP_HIDDEN = 0.5


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


def link_bandwidth(hw: Hardware, lay: Layout, dim: str) -> float:
    """Bytes/s per rank of a collective over mesh dimension `dim`."""
    order = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
    stride = 1
    for name in order[: order.index(dim)]:
        stride *= getattr(lay, name)
    size = getattr(lay, dim)
    return hw.intra_node_bytes_per_s if size * stride <= hw.gpus_per_node else hw.inter_node_bytes_per_s


def ring_time(bytes_: float, n: int, bw: float, *, all_reduce: bool = False) -> float:
    """All-gather / reduce-scatter (all-reduce: twice) of `bytes_` (the whole tensor) over n ranks."""
    if n <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (n - 1) / n * bytes_ / bw


def peak_flops(job: Job, hw: Hardware) -> float:
    return hw.bf16_flops if job.bf16 else hw.fp32_flops


def matmul_efficiency(rows: float, width: float) -> float:
    """The achievable fraction of peak for matmuls of `rows` tokens and `width` columns per
    rank: tiles of a small matrix leave the GPU's units idle (a matmul of 128 rows runs at
    about half the rate of a large one)."""
    return MATMUL_EFFICIENCY * rows / (rows + HALF_RATE_SIZE) * width / (width + HALF_RATE_SIZE)


def recompute_factor(lay: Layout) -> float:
    """Block FLOPs with recomputation: full AC reruns the forward (1/3 of 6N more)."""
    if lay.ac == "full":
        return 4 / 3
    if lay.ac == "selective" and lay.ac_every:
        return 1 + 1 / (3 * lay.ac_every)
    return 1.02 if lay.ac == "selective" else 1.0  # op level: elementwise ops only


def predict_time(job: Job, lay: Layout, hw: Hardware) -> TimeBreakdown:
    """The step time of the slowest pipeline rank."""
    return max((_rank_time(job, lay, hw, rm) for rm in end_ranks(job, lay)), key=lambda t: t.total)


def _rank_time(job: Job, lay: Layout, hw: Hardware, rm) -> TimeBreakdown:
    a = job.args
    micro = lay.microbatches(job.global_batch_size)
    tokens_mb = lay.sequences_per_microbatch(job.global_batch_size) * job.seq_len / lay.cp  # per micro-batch
    tokens = tokens_mb * micro
    rate = peak_flops(job, hw) * matmul_efficiency(tokens_mb, min(a.dim, a.n_heads * a.head_dim / lay.tp))
    linear_rate = rate * (FLOAT8_GAIN if job.float8 and hw.fp8_flops else 1.0)
    attention = 12 * a.n_heads * a.head_dim * job.seq_len
    n_blocks = sum(len(idx) for _, idx in rm.groups)
    block_flops = sum(b.flops_per_token * len(idx) for b, idx in rm.groups)
    attn_flops = attention * n_blocks
    linear_flops = (block_flops - attn_flops) * recompute_factor(lay) / lay.tp
    attn_flops = attn_flops * recompute_factor(lay) / lay.tp
    out_flops = job.shape.output_flops_per_token / lay.tp if rm.last else 0.0
    compute = tokens * ((linear_flops + out_flops) / linear_rate + attn_flops / rate)
    compute *= 1.0 if job.compiled else EAGER_OVERHEAD
    t = TimeBreakdown(compute=compute)
    act = 2 if job.bf16 else 4
    if lay.tp > 1:  # per block: 2 gathers + 2 reduce-scatters forward, the same backward (+ recompute)
        ops = 8 + (4 if lay.ac == "full" else 0)
        per_op = ring_time(tokens_mb * a.dim * act, lay.tp, link_bandwidth(hw, lay, "tp"))
        t.tp_comm = ops * per_op * n_blocks * micro * (1 - ASYNC_TP_HIDDEN if job.async_tp else 1.0)
    if lay.cp > 1:  # ring attention passes K and V around; it overlaps the attention kernels
        kv = 2 * tokens_mb * a.n_kv_heads * a.head_dim * act
        ring = 3 * (lay.cp - 1) * kv / link_bandwidth(hw, lay, "cp") * n_blocks * micro
        t.cp_comm = max(0.0, ring - tokens * attn_flops / rate)
    moe_blocks = sum(len(idx) for b, idx in rm.groups if b.moe)
    if lay.ep > 1 and moe_blocks:  # dispatch and combine, forward and backward
        volume = getattr(a, "top_k", 1) * tokens_mb * a.dim * act
        t.ep_comm = 4 * moe_blocks * micro * ring_time(volume, lay.ep, link_bandwidth(hw, lay, "dp_shard"))
    t.fsdp_comm_exposed = _fsdp_exposed(job, lay, hw, rm, compute)
    t.offload = offload_time(job, lay, rm)
    if lay.pp > 1:
        t.pp_bubble = compute * bubble_fraction(lay, micro)
        t.pp_comm = 2 * micro * tokens_mb * a.dim * act / link_bandwidth(hw, lay, "pp") * rm.stages
    return t


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
    bw = link_bandwidth(hw, lay, "dp_shard")
    comm = 0.0
    if lay.fsdp > 1:
        gathers = 2 if lay.reshard_after_forward else 1
        comm += gathers * ring_time(elements * gather_width, lay.fsdp, bw)
        comm += ring_time(elements * 4, lay.fsdp, bw)  # gradients reduced in fp32
        if lay.pp == 1:  # without a pipeline, FSDP reduces every micro-batch
            comm += (lay.microbatches(job.global_batch_size) - 1) * ring_time(elements * 4, lay.fsdp, bw)
    if lay.dp_replicate > 1:
        comm += ring_time(elements / max(1, lay.fsdp) * 4, lay.dp_replicate,
                          link_bandwidth(hw, lay, "dp_replicate"), all_reduce=True)
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
    """(tokens/s of the whole job, per device, MFU) at `step_time`."""
    tokens = job.tokens_per_step / step_time
    per_device = tokens / lay.world_size
    flops = job.shape.flops_per_token * per_device
    return tokens, per_device, flops / peak_flops(job, hw)
