"""The search: every layout of the world, predicted, checked against the device's memory and
ranked by tokens/s.

    job = job_from_config(cfg, gpu=True)
    ranked = plan(job, get_hardware("h100"), world=64)     # best first; ranked[0].fits
    one = evaluate(job, layout, hw)                          # a given layout
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from forja.parallel.pp import microbatch_error
from forja.plan.hardware import Hardware
from forja.plan.job import Job
from forja.plan.layout import Layout, SearchSpace, enumerate_layouts
from forja.plan.memory import MemoryBreakdown, predict_memory
from forja.plan.speed import TimeBreakdown, predict_time, throughput

# A GPU's torch allocator cannot use it all: the CUDA context and NCCL's buffers sit outside
# it, and the caching allocator's blocks fragment. CPU ranks share the host's memory.
GPU_RESERVED_BYTES = 3e9
FRAGMENTATION = 0.95


def usable_memory(hw: Hardware) -> float:
    """Bytes the allocator peak of one rank may reach."""
    if hw.kind == "cpu":
        return hw.memory_bytes * FRAGMENTATION
    return (hw.memory_bytes - GPU_RESERVED_BYTES) * FRAGMENTATION


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    tokens_per_sec: float
    tokens_per_sec_per_device: float
    mfu: float
    fits: bool
    why_not: str = ""

    def as_json(self) -> dict:
        return {
            "layout": self.layout.overrides(),
            "description": self.layout.describe(),
            "peak_memory_bytes": round(self.memory.total),
            "memory_breakdown": {k: round(v) for k, v in self.memory.as_dict().items()},
            "peak_phase": self.memory.phase,
            "step_time_s": self.time.total,
            "time_breakdown": self.time.as_dict(),
            "tokens_per_sec": self.tokens_per_sec,
            "tokens_per_sec_per_device": self.tokens_per_sec_per_device,
            "mfu": self.mfu,
            "fits": self.fits,
            "why_not": self.why_not,
        }


def layout_error(job: Job, lay: Layout, hw: Hardware) -> str | None:
    """Why forja train would refuse `lay` for `job`, in one sentence; None if it runs."""
    a = job.args
    dp = lay.dp
    if job.global_batch_size % dp:
        return f"train.global_batch_size = {job.global_batch_size} is not divisible by the {dp} data-parallel ranks"
    if (job.global_batch_size // dp) % lay.micro_batch_size:
        return f"the local batch {job.global_batch_size // dp} is not divisible by micro_batch_size {lay.micro_batch_size}"
    if a.n_heads % lay.tp:
        return f"tp = {lay.tp} does not divide the {a.n_heads} attention heads"
    if lay.pp * lay.stages_per_rank > a.n_layers:
        return f"pp = {lay.pp} x {lay.stages_per_rank} stages is more than the {a.n_layers} layers"
    if lay.cp > 1 and (hw.kind == "cpu" or lay.ep > 1):
        return "context parallelism needs CUDA and no expert parallelism"
    n_experts = getattr(a, "n_experts", 0)
    if lay.ep > 1 and (not n_experts or n_experts % lay.ep or lay.dp_shard % lay.ep):
        return f"ep = {lay.ep} must divide the experts ({n_experts}) and dp_shard ({lay.dp_shard})"
    if lay.pp > 1:
        local = job.global_batch_size // dp
        micro = lay.microbatches(job.global_batch_size)
        error = microbatch_error(lay.pp_schedule, lay.pp, micro, local, "the plan")
        if error:
            return error
    return None


def evaluate(job: Job, lay: Layout, hw: Hardware) -> Candidate:
    """One layout's prediction."""
    error = layout_error(job, lay, hw)
    memory = predict_memory(job, lay)
    time = predict_time(job, lay, hw)
    tokens, per_device, mfu = throughput(job, lay, hw, time.total)
    limit = usable_memory(hw)
    fits = error is None and memory.total <= limit
    why = error or ("" if fits else f"needs {memory.total / 1e9:.1f} GB at its peak ({memory.phase}); "
                                    f"{limit / 1e9:.1f} GB usable")
    return Candidate(lay, memory, time, tokens, per_device, mfu, fits, why)


def plan(job: Job, hw: Hardware, world: int, *, space: SearchSpace | None = None) -> list[Candidate]:
    """Every layout of `world` ranks, the fitting ones first (fastest first), then the others
    (smallest peak first)."""
    space = space or SearchSpace(gpus_per_node=hw.gpus_per_node, allow_cp=hw.kind != "cpu",
                                 allow_offload=hw.kind != "cpu")
    a = job.args
    layouts = enumerate_layouts(world, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                                n_experts=getattr(a, "n_experts", 0), global_batch_size=job.global_batch_size,
                                seq_len=job.seq_len, space=space)
    out, fitting = [], set()
    for lay in layouts:
        if lay.cpu_offload and replace(lay, cpu_offload=False) in fitting:
            continue  # offload only pays where the same layout without it does not fit
        out.append(evaluate(job, lay, hw))
        if out[-1].fits:
            fitting.add(lay)
    best = max((c.tokens_per_sec for c in out if c.fits), default=1.0)

    def rank(c: Candidate) -> tuple:
        # Within 0.5% of each other layouts are as fast: prefer the simpler one (fewer kinds
        # of parallelism, no offload), then the one with more memory to spare.
        if not c.fits:
            return (1, c.memory.total)
        return (0, -round(200 * c.tokens_per_sec / best), complexity(c.layout), c.memory.total)

    return sorted(out, key=rank)


def complexity(lay: Layout) -> int:
    """How many things a layout asks of the user beyond plain FSDP: each kind of parallelism,
    replication, offload and recomputation."""
    kinds = sum(getattr(lay, k) > 1 for k in ("dp_replicate", "tp", "pp", "cp", "ep"))
    return kinds + lay.cpu_offload + (lay.ac != "none")
