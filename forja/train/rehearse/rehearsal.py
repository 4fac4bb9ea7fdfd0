"""A run's rehearsal: each distinct rank position rehearsed (forja/train/rehearse/run.py) and
set beside the planner's prediction for that rank (forja/plan/memory.py).

    r = rehearse(cfg, world_size=64, hw=get_hardware("h100"))
    print_rehearsal(r)                       # predicted vs rehearsed, by category; collectives
    r.as_json()

The rank positions: without pipeline parallelism every rank holds the same (rank 0 stands
for all; under expert parallelism each holds its experts alike); with it, the first stage
(the most micro-batches in flight, the embedding) and the last (the output and the loss).

What is rehearsed is the program a GPU rank runs, eager: `train.precision = "auto"` is a
GPU's bf16, `parallel.compile` is off, fused Triton kernels are their PyTorch references
(EAGER_NOTE); the prediction it is compared with is the planner's for that same program.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from forja.config import Config
from forja.errors import ForjaError
from forja.models.config import run_model_args
from forja.parallel.checks import check_layout
from forja.parallel.pp_split import V_SCHEDULES
from forja.plan.hardware import Hardware
from forja.plan.job import Job, job_from_config
from forja.plan.layout import Layout
from forja.plan.memory import MemoryBreakdown, rank_model, rank_peak
from forja.plan.planner import layout_request, usable_memory
from forja.train.rehearse.routing import ROUTING_NOTE
from forja.train.rehearse.run import EAGER_NOTE, RankRehearsal, rehearse_rank
from forja.train.rehearse.tracker import CATEGORIES

GB = 1e9
# The planner's parts of a peak, as the rehearsal's categories name them.
PREDICTED_AS = {"parameters": "parameters", "gathered_parameters": "gathered_parameters", "gradients": "gradients",
                "optimizer_state": "optimizer_state", "activations": "activations", "logits": "activations",
                "optimizer_temporaries": "temporaries", "buffers": "communication"}


@dataclass
class Rehearsal:
    layout: str
    world_size: int
    hardware: str
    usable_bytes: float
    ranks: list[RankRehearsal]
    predicted: list[MemoryBreakdown]
    """The planner's peak of each rank rehearsed, in the same order."""
    seconds: float
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"layout": self.layout, "world_size": self.world_size, "hardware": self.hardware,
                "usable_bytes": round(self.usable_bytes) if self.hardware else None,
                "seconds": round(self.seconds, 1), "notes": self.notes,
                "ranks": [{**r.as_json(), "predicted_bytes": round(p.total), "predicted_phase": p.phase,
                           "predicted_by_category": predicted_categories(p),
                           "error": p.total / r.peak_bytes - 1}
                          for r, p in zip(self.ranks, self.predicted)]}

    @property
    def fits(self) -> bool:
        return max(r.peak_bytes for r in self.ranks) <= self.usable_bytes


def rehearsal_config(cfg: Config) -> Config:
    """`cfg` as a GPU rank runs it eagerly (the module's docstring)."""
    train = cfg.train
    if train.precision == "auto":
        train = dataclasses.replace(train, precision="bf16")
    # Async TP is a compiled graph's rewrite (the same tensors, overlapped): off with compile.
    return dataclasses.replace(cfg, train=train, parallel=dataclasses.replace(cfg.parallel, compile=False,
                                                                             async_tp=False))


def fewer_pipeline_microbatches(cfg: Config, world_size: int) -> tuple[Config, str]:
    """A pipeline step of many micro-batches, rehearsed with 2 x pp x stages per rank of them, of
    the same size, and a note saying so ("" when nothing changed). Past that count a schedule's
    micro-batches in flight, and so its peak, stop growing (1F1B holds at most pp, the
    interleaved and V schedules fewer than 2 pp v; every earlier gradient is accumulated whole
    either way), while each one costs the rehearsal a stage's forward and backward; the stages
    still allocate a receive buffer for every micro-batch of the step (`receive_buffers_for`).
    GPipe, which holds them all, is rehearsed whole."""
    lay = Layout.from_config(cfg.parallel, cfg.train.micro_batch_size, world_size)
    m = lay.microbatches(cfg.train.global_batch_size)
    cap = 2 * lay.pp * lay.stages_per_rank
    if lay.pp == 1 or lay.pp_schedule == "gpipe" or m <= cap:
        return cfg, ""
    rows = round(lay.sequences_per_microbatch(cfg.train.global_batch_size))
    train = dataclasses.replace(cfg.train, global_batch_size=lay.dp * cap * rows)
    parallel = dataclasses.replace(cfg.parallel, pp_microbatches=cap if cfg.parallel.pp_microbatches else 0)
    note = (f"the pipeline step's {m} micro-batches rehearsed as {cap} of the same {rows} sequences: past "
            f"2 x pp x stages per rank the micro-batches in flight stop growing (a receive buffer is held for "
            f"each of the {m})")
    return dataclasses.replace(cfg, train=train, parallel=parallel), note


def rank_positions(cfg: Config, world_size: int) -> list[tuple[int, str]]:
    """(global rank, what it stands for) of each distinct position; the pipeline dimension is
    the mesh's outermost, so stage s starts at rank s * world / pp."""
    pp = cfg.parallel.degrees.resolve(world_size).pp
    if pp == 1:
        return [(0, "every rank")]
    last = (pp - 1) * (world_size // pp)
    if cfg.parallel.pp_schedule in V_SCHEDULES:  # rank 0 holds the V's two ends
        return [(0, "first and last stage"), (last, "middle stages")]
    return [(0, "first stage"), (last, "last stage")]


def rehearse(cfg: Config, world_size: int, hw: Hardware | None = None) -> Rehearsal:
    """Rehearse `cfg`'s layout on `world_size` ranks of `hw` (ForjaError for a layout the
    validator refuses: nothing is built then)."""
    began = time.perf_counter()
    cfg = rehearsal_config(cfg)
    args = run_model_args(cfg.model, cfg.data.vocab_size)
    job = _job(cfg, args)  # the program rehearsed: eager, the fused ops' CPU paths
    check_layout(layout_request(job, "cuda", world_size))
    _check_rehearsable(cfg, args, world_size)
    lay = Layout.from_config(cfg.parallel, cfg.train.micro_batch_size, world_size)
    step_microbatches = lay.microbatches(cfg.train.global_batch_size)
    shorter, fewer = fewer_pipeline_microbatches(cfg, world_size)
    ranks, predicted = [], []
    for rank, position in rank_positions(cfg, world_size):  # the whole step predicted; a shorter one rehearsed
        ranks.append(rehearse_rank(shorter, args, world_size, rank, position, step_microbatches))
        predicted.append(_predicted(job, lay, rank // (world_size // lay.pp)))
    return Rehearsal(layout=lay.describe(), world_size=world_size, hardware=hw.name if hw else "",
                     usable_bytes=usable_memory(hw) if hw else float("inf"),
                     ranks=ranks, predicted=predicted, seconds=time.perf_counter() - began,
                     notes=[EAGER_NOTE] + ([ROUTING_NOTE] if getattr(args, "n_experts", 0) else [])
                     + ([fewer] if fewer else []))


# Fused ops whose path on the rehearsal's CPU tensors holds what the kernel holds: the chunked
# loss runs its chunk loop in PyTorch (no logits kept); the fused RMSNorm and SwiGLU run their
# plain PyTorch definitions there (forja/ops/dispatch.py), which keep what unfused code keeps.
_KERNEL_MEMORY_ON_CPU = frozenset({"cross_entropy"})


def _job(cfg: Config, args) -> Job:
    """The planner's job for the program rehearsed: a GPU's, eager, with the fused ops that hold
    on the CPU what they hold on a GPU, fla's kernels off."""
    job = job_from_config(cfg, gpu=True, args=args)
    return dataclasses.replace(job, fused=job.fused & _KERNEL_MEMORY_ON_CPU, fla=False)


def _check_rehearsable(cfg: Config, args, world_size: int) -> None:
    """What a fake tensor cannot run yet, refused before anything is built."""
    if getattr(args, "n_experts", 0) and getattr(args, "capacity_factor", 0) > 0:
        raise ForjaError(f"the rehearsal cannot run a capacity factor ({args.capacity_factor:g}): which token-slots "
                         "an expert keeps depends on the router's values, which fake tensors do not hold; rehearse "
                         "the dropless layer (model.overrides = {capacity_factor=0}), which holds at least as much")


def _predicted(job: Job, lay: Layout, pp_rank: int) -> MemoryBreakdown:
    return rank_peak(job, lay, rank_model(job, lay, pp_rank))


def predicted_categories(m: MemoryBreakdown) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for name, value in m.as_dict().items():
        out[PREDICTED_AS[name]] += round(value)
    return out


def print_rehearsal(r: Rehearsal, console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"rehearsal: {r.layout} on {r.world_size} ranks, peak per rank (GB) against "
                        f"{r.usable_bytes / GB:.1f} GB usable of {r.hardware}", title_justify="left")
    table.add_column("")
    for rank, pred in zip(r.ranks, r.predicted):
        table.add_column(f"{rank.position}: predicted", justify="right")
        table.add_column(f"rank {rank.rank}: rehearsed", justify="right")
    columns = [(predicted_categories(p), rank.by_category) for rank, p in zip(r.ranks, r.predicted)]
    for name in CATEGORIES:
        table.add_row(name.replace("_", " "), *[f"{c[name] / GB:.2f}" for pair in columns for c in pair])
    table.add_row("peak", *[f"{v / GB:.2f}" for rank, p in zip(r.ranks, r.predicted)
                            for v in (p.total, rank.peak_bytes)])
    table.add_row("when", *[w for rank, p in zip(r.ranks, r.predicted) for w in (p.phase, rank.peak_phase)])
    console.print(table)
    for rank in r.ranks:
        _print_collectives(console, rank)
    for note in r.notes:
        console.print(f"note: {note}", highlight=False)
    verdict = "fits" if r.fits else "does NOT fit"
    console.print(f"rehearsed in {r.seconds:.0f} s: the layout {verdict} ({max(x.peak_bytes for x in r.ranks) / GB:.1f}"
                  f" GB at the highest rank's peak)", highlight=False)


def _print_collectives(console: Console, rank: RankRehearsal) -> None:
    table = Table(title=f"collectives of one step, rank {rank.rank} ({rank.position}; "
                        f"{rank.microbatches_rehearsed} of {rank.microbatches} micro-batches rehearsed)",
                  title_justify="left")
    for col in ("kind", "group", "count", "GB"):
        table.add_column(col, justify="left" if col in ("kind", "group") else "right")
    for row in rank.collectives:
        table.add_row(row["kind"], row["group"], str(row["count"]), f"{row['bytes'] / GB:.3f}")
    console.print(table)


def rehearse_apart(cfg: Config, world_size: int, timeout_s: float = 1800.0) -> dict:
    """`rehearse` in a process of its own (this one may hold a process group): its JSON."""
    import json
    import subprocess

    from forja.config import dump_toml

    done = subprocess.run([sys.executable, "-m", "forja.train.rehearse", str(world_size)], input=dump_toml(cfg),
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ForjaError(f"the rehearsal of this layout failed ({tail}); parallel.memory_check = 'stop' "
                         "checks the planner's prediction instead")
    out = json.loads(lines[-1])
    if "error" in out:
        raise ForjaError(out["error"])
    return out
