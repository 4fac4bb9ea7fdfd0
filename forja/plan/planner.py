"""The search: every layout of the world, predicted, checked against the device's memory and
ranked by tokens/s.

    job = job_from_config(cfg, gpu=True)
    ranked = plan(job, get_hardware("h100"), world=64)     # best first; ranked[0].fits
    one = evaluate(job, layout, hw)                          # a given layout
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from forja.models.common.moe import MoEArgs
from forja.parallel.checks import LayoutRequest, layout_errors
from forja.parallel.degrees import Axis
from forja.plan.hardware import Hardware
from forja.plan.job import Job
from forja.plan.layout import Layout, SearchSpace, enumerate_layouts
from forja.plan.memory import MemoryBreakdown, predict_memory
from forja.plan.speed import TimeBreakdown, predict_time, throughput

# A GPU's torch allocator cannot use all the memory the device reports (hardware.toml's
# memory_gib): the CUDA context, NCCL's buffers and cuBLAS's workspaces sit outside it
# (GPU_RESERVED_BYTES), and what the allocator reserves exceeds the live tensors the model
# and a rehearsal count, by its rounding and fragmentation (live = reserved x FRAGMENTATION).
# torchtitan's published peaks are reserved bytes, up to 84.9 GiB (the 405B at 256k tokens)
# on H100s of 96 GB (95 GiB reported), under the 95 - 2.8 GiB these terms leave them.
# CPU ranks share the host's memory.
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
    runs: bool = True
    """Whether forja train accepts the layout (the validator); fits also needs the memory."""

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
            "runs": self.runs,
            "why_not": self.why_not,
        }


def layout_request(job: Job, device_type: str, world_size: int, layout: Layout | None = None) -> LayoutRequest:
    """What the layout validator judges: `job` on `world_size` ranks of `device_type` ("cuda" or
    "cpu"), laid out as its recipe's `[parallel]` says, or as `layout` says (its keys over the
    recipe's section). The one place a run's settings become a request: `forja plan`,
    `parallel.auto`, the memory check and `forja train`'s preflight all come through here."""
    parallel, micro = job.parallel, job.micro_batch_size
    if layout is not None:
        parallel, micro = layout.parallel(job.parallel), layout.micro_batch_size
    return LayoutRequest(args=job.args, parallel=parallel, world_size=world_size, seq_len=job.seq_len,
                         global_batch_size=job.global_batch_size, micro_batch_size=micro, device_type=device_type,
                         document_mask=job.document_mask, float8=job.float8_recipe, precision=job.precision,
                         seq_lens=job.seq_lens, qk_clip_tau=job.qk_clip_tau, max_logit_metric=job.max_logit_metric,
                         ft=job.ft, check_interval=job.check_interval, ft_replicas=job.ft_replicas)


def device_type_of(hw: Hardware) -> str:
    """The torch device type ranks of `hw` run on."""
    return "cpu" if hw.kind == "cpu" else "cuda"


def layout_error(job: Job, lay: Layout, hw: Hardware) -> str | None:
    """Why forja train would refuse `lay` for `job` (the validator's first reason); None if it runs."""
    errors = layout_errors(layout_request(job, device_type_of(hw), lay.world_size, lay))
    return errors[0] if errors else None


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
    return Candidate(lay, memory, time, tokens, per_device, mfu, fits, why, runs=error is None)


def default_space(hw: Hardware) -> SearchSpace:
    """What the search varies on `hw`: no context parallelism or offload on CPUs."""
    return SearchSpace(gpus_per_node=hw.gpus_per_node, allow_cp=hw.kind != "cpu", allow_offload=hw.kind != "cpu")


def plan(job: Job, hw: Hardware, world: int, *, space: SearchSpace | None = None) -> list[Candidate]:
    """Every layout of `world` ranks, the fitting ones first (fastest first), then the others
    (smallest peak first). A layout fits when the validator accepts it and its peak fits."""
    space = space or default_space(hw)
    a = job.args
    layouts = enumerate_layouts(world, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                                n_experts=a.n_experts if isinstance(a, MoEArgs) else 0,
                                global_batch_size=job.global_batch_size,
                                seq_len=job.seq_len, space=space)
    out, fitting = [], set()
    for lay in layouts:
        if lay.cpu_offload and replace(lay, cpu_offload=False) in fitting:
            continue  # offload only pays where the same layout without it does not fit
        out.append(evaluate(job, lay, hw))
        if out[-1].fits:
            fitting.add(lay)
    # An unknown peak predicts no speed (0 tokens/s): the fitting layouts then rank by simplicity and memory.
    best = max((c.tokens_per_sec for c in out if c.fits), default=0.0) or 1.0

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
    kinds = sum(degree > 1 for axis, degree in lay.degrees.items() if axis is not Axis.DP_SHARD)
    return kinds + lay.cpu_offload + (lay.ac != "none")
