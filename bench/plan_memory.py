"""Measured per-rank peak memory of parallel layouts, on CPU (Gloo): the ground truth that
`forja plan`'s memory model is checked against.

Each layout runs in its own group of processes (`forja.testing.run_distributed`, one per
rank). A rank builds what `forja train`'s `Trainer.setup` builds, through the same
functions: `ParallelDims` and its mesh, `run_model_args`, `check_layout`,
`build_model_parts` (TP/SP -> AC -> FSDP/HSDP/replication, EP, pipeline stages),
`OptimizerGroup` (AdamW, the default optim config), `SchedulerGroup` and `build_engine`
(plain or pipelined), fp32. Batches are random tokens in `forja.data.load.loader.Batch`es, one
document per sequence, as many micro-batches per rank as the data loader would hand it
(train.global_batch_size / (micro batch x data-parallel degree)).

One warm-up `engine.train_step` creates the optimizer state; the next steps are measured.
A step is the engine's whole step: zero_grad, forward + backward of every micro-batch (or
the pipeline schedule), tied-copy sync, gradient clipping, optimizer and schedule step.

Per rank (bytes):

- **param / grad / optim / buffer**: the distinct storages of the parameters (a DTensor's
  local shard), their gradients, the optimizer state and the buffers, between steps
  (`storage_bytes`, as in bench/memory.py). Gradients are kept between steps: the engine
  frees them at the start of the next step. **state** = param + grad + optim.
- **peak**: the tensors alive at the start of a measured step (param + grad + optim +
  buffer) plus the highest point of the running sum of every allocation and free of torch's
  CPU allocator during the step (`torch.profiler`, profile_memory), as bench/memory.py does.
- **drift**: what that running sum gained over the step. The profiler records only this
  thread's allocations and frees; a tensor whose last reference a Gloo worker thread drops
  (the output of an async all-gather, when the worker is late to let go of its work
  object) is freed unseen, so the sum drifts up by it and the peak may be overstated by up
  to the drift. It happens at random, so MEASURED_STEPS steps are measured and the one that
  drifted least is kept: 0 means the figures are exact.
- **untracked_start**: bytes alive at the start of that step by the running sum since
  before the model was built, less the counted storages: buffers the code keeps between
  steps that no parameter, gradient or optimizer state holds, plus any unseen frees before
  the step (an upper bound, then). Not part of peak.

Memory Gloo or other libraries allocate outside torch's allocator is not counted.

    python bench/plan_memory.py                        # every layout -> bench/plan_memory.json
    python bench/plan_memory.py --only fsdp2 tp2-sp    # some of them
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# torch and forja are imported inside the functions that need them: spawned processes
# (each rank, and run_distributed's Manager) re-import this file when it is the main script,
# and a light top saves a Manager the seconds an import of torch costs on a busy machine.

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "bench"))  # bench/memory.py

MB = 1e6
SEED = 0
MEASURED_STEPS = 3
STEP_MARK = "plan_memory.step"

# (name, family, flavor, world size, parallel, micro batch, seq_len, global batch or None)
# Pipelines take 4 microbatches of 2 sequences: the global batch is 8 per data-parallel rank.
# Context parallelism is left out: it runs on CUDA attention kernels only (check_layout stops it).
_TINY, _DEBUG, _MOE = ("llama", "tiny"), ("llama", "debug"), ("qwen3", "debug-moe")
_PP = {"pp": 2, "dp_shard": 1, "pp_microbatches": 4}
LAYOUTS: list[tuple] = [
    ("single", *_TINY, 1, {}, 4, 256, None),
    ("ddp2", *_TINY, 2, {"dp_replicate": 2, "dp_shard": 1}, 4, 256, None),
    ("fsdp2", *_TINY, 2, {"dp_shard": 2}, 4, 256, None),
    ("fsdp4", *_TINY, 4, {"dp_shard": 4}, 4, 256, None),
    ("zero2-2", *_TINY, 2, {"dp_shard": 2, "reshard_after_forward": False}, 4, 256, None),
    ("hsdp2x2", *_TINY, 4, {"dp_replicate": 2, "dp_shard": 2}, 4, 256, None),
    ("tp2-sp", *_TINY, 2, {"dp_shard": 1, "tp": 2}, 4, 256, None),
    ("tp2-nosp", *_TINY, 2, {"dp_shard": 1, "tp": 2, "sequence_parallel": False}, 4, 256, None),
    ("fsdp2-tp2", *_TINY, 4, {"dp_shard": 2, "tp": 2}, 4, 256, None),
    ("pp2-gpipe", *_TINY, 2, {**_PP, "pp_schedule": "gpipe"}, 2, 256, 8),
    ("pp2-1f1b", *_TINY, 2, {**_PP, "pp_schedule": "1f1b"}, 2, 256, 8),
    ("pp2-interleaved-1f1b", *_TINY, 2, {**_PP, "pp_schedule": "interleaved-1f1b"}, 2, 256, 8),
    ("pp2-zero-bubble", *_TINY, 2, {**_PP, "pp_schedule": "zero-bubble"}, 2, 256, 8),
    ("pp2-fsdp2", *_TINY, 4, {**_PP, "dp_shard": 2}, 2, 256, 16),
    ("ac-full", *_TINY, 1, {"ac": "full"}, 4, 256, None),
    ("ac-selective-op", *_TINY, 1, {"ac": "selective", "ac_every": 0}, 4, 256, None),
    ("ac-selective-2", *_TINY, 1, {"ac": "selective", "ac_every": 2}, 4, 256, None),
    ("fsdp2-ac-full", *_TINY, 2, {"dp_shard": 2, "ac": "full"}, 4, 256, None),
    ("accum2", *_TINY, 1, {}, 2, 256, 4),  # two micro-batches of 2 per step
    ("debug-single", *_DEBUG, 1, {}, 4, 128, None),
    ("debug-fsdp2", *_DEBUG, 2, {"dp_shard": 2}, 4, 128, None),
    ("debug-tp2-sp", *_DEBUG, 2, {"dp_shard": 1, "tp": 2}, 4, 128, None),
    ("debug-pp2-1f1b", *_DEBUG, 2, {**_PP, "pp_schedule": "1f1b"}, 2, 128, 8),  # tied copies on both ends
    ("moe-single", *_MOE, 1, {}, 4, 128, None),
    ("moe-ep2", *_MOE, 2, {"dp_shard": 2, "ep": 2}, 4, 128, None),
    ("moe-ep2-fsdp2", *_MOE, 4, {"dp_shard": 4, "ep": 2}, 4, 128, None),
]


# -- one rank -------------------------------------------------------------------------------
def _build(world_size: int, family: str, flavor: str, parallel: dict, micro: int, seq_len: int, global_batch: int):
    """(engine, dims, parts, optimizers, micro-batches per step, vocab), as Trainer.setup builds them."""
    import torch

    from forja.data.load.loader import check_batch_sizes
    from forja.models import model_args
    from forja.models.config import ModelConfig, run_model_args
    from forja.optim import OptimizerGroup, SchedulerGroup
    from forja.optim.config import OptimConfig, ScheduleConfig
    from forja.parallel import ParallelConfig, ParallelDims
    from forja.parallel.checks import LayoutRequest, check_layout
    from forja.train.build import build_model_parts
    from forja.train.config import TrainConfig
    from forja.train.step.build import build_engine

    train = TrainConfig(seed=SEED, seq_len=seq_len, global_batch_size=global_batch, micro_batch_size=micro,
                        precision="fp32")
    pcfg = ParallelConfig(**{"timeout_s": 120.0, **parallel})
    dims = ParallelDims.from_config(pcfg, world_size)
    dims.build_mesh("cpu")
    model_cfg = ModelConfig(family=family, flavor=flavor)  # document_mask on, the default
    args = run_model_args(model_cfg, model_args(family, flavor).vocab_size)  # the flavor's own vocabulary
    device = torch.device("cpu")
    check_layout(LayoutRequest(args=args, parallel=pcfg, world_size=world_size, seq_len=seq_len, device_type="cpu",
                               global_batch_size=global_batch, micro_batch_size=micro,
                               document_mask=model_cfg.document_mask))
    built = build_model_parts(args, dims, pcfg, device=device, seed=train.seed, seq_len=seq_len)
    optimizers = OptimizerGroup(built.parts, OptimConfig())
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(), total_steps=10)
    engine = build_engine(built.parts, built.pipeline, optimizers, scheduler, dims, device=device,
                          precision=train.precision, grad_clip=train.grad_clip,
                          document_mask=model_cfg.document_mask)
    accumulation = check_batch_sizes(global_batch, micro, dims.dp)
    return engine, dims, built.parts, optimizers, accumulation, args.vocab_size


def _batches(step: int, dp_rank: int, n: int, micro: int, seq_len: int, vocab: int) -> list:
    """Random micro-batches, the same on every rank of one data-parallel replica (TP and PP
    ranks must see the same tokens)."""
    import torch

    from forja.data.load.loader import Batch

    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (micro, seq_len + 1), generator=gen)
        # One document per sequence: a real loader's document ids may split one into several.
        out.append(Batch(tokens[:, :-1].clone(), tokens[:, 1:].clone(), torch.zeros(micro, seq_len, dtype=torch.long)))
    return out


def _state(parts, optimizers) -> dict[str, int]:
    from memory import optimizer_tensors, storage_bytes

    params = [p for part in parts for p in part.parameters()]
    buffers = [b for part in parts for b in part.buffers()]
    optim = optimizer_tensors(optimizers)
    return {"param_bytes": storage_bytes(params), "grad_bytes": storage_bytes(p.grad for p in params),
            "optim_bytes": storage_bytes(optim), "buffer_bytes": storage_bytes(buffers),
            # A storage two kinds share counts once.
            "start_bytes": storage_bytes([*params, *(p.grad for p in params), *optim, *buffers])}


def _steps(prof) -> list[dict[str, int]]:
    """Per measured step, from every allocation and free since profiling began:
    alive (the running sum at its start), rise (its highest point above that), drift (its gain)."""
    events = list(prof.profiler.kineto_results.events())
    records = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    marks = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == STEP_MARK)
    out, running, i = [], 0, 0
    for start, end in marks:
        while i < len(records) and records[i][0] < start:
            running += records[i][1]
            i += 1
        alive = peak = running
        while i < len(records) and records[i][0] <= end:
            running += records[i][1]
            peak = max(peak, running)
            i += 1
        out.append({"alive": alive, "rise": peak - alive, "drift": running - alive})
    return out


def _rank(rank: int, world_size: int, family: str, flavor: str, parallel: dict, micro: int, seq_len: int,
          global_batch: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)  # several ranks share the cores
    torch.manual_seed(SEED)
    # Profiling from before the build makes the running sum of allocations what this process holds.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine, dims, parts, optimizers, n, vocab = _build(world_size, family, flavor, parallel, micro, seq_len,
                                                           global_batch)
        losses = [engine.train_step(_batches(0, dims.dp_rank, n, micro, seq_len, vocab)).loss]  # optimizer state
        states = []
        for step in range(1, MEASURED_STEPS + 1):
            batches = _batches(step, dims.dp_rank, n, micro, seq_len, vocab)
            states.append(_state(parts, optimizers))
            with record_function(STEP_MARK):
                losses.append(engine.train_step(batches).loss)
    steps = _steps(prof)  # keep the step that drifted least (the first of equals): the fewest frees unseen
    best = min(range(MEASURED_STEPS), key=lambda s: abs(steps[s]["drift"]))
    step, state = steps[best], states[best]
    return {"rank": rank, **state, "state_bytes": state["param_bytes"] + state["grad_bytes"] + state["optim_bytes"],
            "peak_bytes": state["start_bytes"] + step["rise"], "drift_bytes": step["drift"],
            "untracked_start_bytes": step["alive"] - state["start_bytes"], "measured_step": best + 1,
            "microbatches_per_step": n, "losses": losses}


# -- the API --------------------------------------------------------------------------------
def _data_parallel(parallel: dict, world_size: int) -> int:
    from forja.parallel import ParallelConfig, ParallelDims

    return ParallelDims.from_config(ParallelConfig(**parallel), world_size).dp


def measure(family: str, flavor: str, world_size: int, parallel: dict, micro_batch_size: int, seq_len: int,
            global_batch_size: int | None = None, timeout_s: float = 300.0) -> list[dict]:
    """Per-rank memory of a training step of this layout, ordered by rank (see the module
    docstring). global_batch_size defaults to one micro-batch per data-parallel rank."""
    from forja.testing import run_distributed

    if global_batch_size is None:
        global_batch_size = micro_batch_size * _data_parallel(parallel, world_size)
    return run_distributed(_rank, world_size, family, flavor, dict(parallel), micro_batch_size, seq_len,
                           global_batch_size, timeout_s=timeout_s)


def run_layout(layout: tuple) -> dict:
    name, family, flavor, world_size, parallel, micro, seq_len, global_batch = layout
    if global_batch is None:
        global_batch = micro * _data_parallel(parallel, world_size)
    ranks = measure(family, flavor, world_size, parallel, micro, seq_len, global_batch)
    return {"name": name, "family": family, "flavor": flavor, "world_size": world_size, "parallel": parallel,
            "micro_batch_size": micro, "seq_len": seq_len, "global_batch_size": global_batch, "ranks": ranks}


def save(path: Path, data) -> None:
    from forja.files import write_atomic

    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


def predicted(entry: dict):
    """forja plan's prediction (forja/plan/memory.py) for a measured entry: fp32 on a CPU."""
    from forja.models import model_args
    from forja.plan.job import Job
    from forja.plan.layout import Layout
    from forja.plan.memory import predict_memory
    from forja.plan.shape import model_shape

    args = model_args(entry["family"], entry["flavor"])
    job = Job(shape=model_shape(args, entry["seq_len"]), seq_len=entry["seq_len"],
              global_batch_size=entry["global_batch_size"], gpu=False, bf16=False)
    parallel = dict(entry["parallel"])
    others = parallel.get("dp_replicate", 1) * parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1)
    parallel.setdefault("dp_shard", entry["world_size"] // others)
    return predict_memory(job, Layout.of(**parallel, micro_batch_size=entry["micro_batch_size"]))


def compare(results: list[dict]) -> list[str]:
    """Markdown rows: measured and predicted peak of the rank that peaks highest, and the error."""
    lines = ["| layout | ranks | measured peak MB | predicted MB | error | predicted at | largest parts (MB) |",
             "|---|---:|---:|---:|---:|---|---|"]
    for entry in results:
        measured = max(r["peak_bytes"] for r in entry["ranks"])
        pred = predicted(entry)
        parts = sorted(pred.as_dict().items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"| {entry['name']} | {entry['world_size']} | {measured / MB:.1f} | {pred.total / MB:.1f} | "
                     f"{pred.total / measured - 1:+.1%} | {pred.phase} | "
                     + ", ".join(f"{k.replace('_', ' ')} {v / MB:.0f}" for k, v in parts) + " |")
    return lines


def _row(result: dict) -> str:
    def most(key: str) -> str:
        return f"{max(r[key] for r in result['ranks']) / MB:.2f}"

    return (f"| {result['name']} | {result['world_size']} | {most('peak_bytes')} | {most('state_bytes')} "
            f"| {most('drift_bytes')} | {most('untracked_start_bytes')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="layouts to run (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "plan_memory.json")
    parser.add_argument("--compare", action="store_true",
                        help="measure nothing: the saved measurements (--out) against forja plan's predictions")
    ns = parser.parse_args()
    if ns.compare:
        print("\n".join(compare(json.loads(ns.out.read_text()))))
        return
    known = {layout[0]: layout for layout in LAYOUTS}
    unknown = sorted(set(ns.only or ()) - set(known))
    if unknown:
        raise SystemExit(f"no layout {unknown[0]!r}; layouts: {', '.join(known)}")
    chosen = [known[n] for n in ns.only] if ns.only else LAYOUTS
    print("fp32, AdamW, torch CPU allocator; MB = 1e6 bytes, the most of any rank")
    print("| layout | ranks | peak MB | state MB | drift MB | untracked at start MB |\n|---|---|---|---|---|---|")
    results, failed = [], []
    for layout in chosen:
        started = time.perf_counter()
        try:
            results.append(run_layout(layout))
        except RuntimeError as e:  # one failing layout must not lose the others' figures
            failed.append(layout[0])
            print(f"| {layout[0]} | FAILED: {str(e).strip().splitlines()[-1]} |", flush=True)
            continue
        print(f"{_row(results[-1])} {time.perf_counter() - started:.0f}s", flush=True)
    save(ns.out, results)
    if failed:
        raise SystemExit(f"failed layouts: {', '.join(failed)}")


if __name__ == "__main__":
    main()
