"""What a checkpoint costs the training loop, written synchronously vs in the background.

    python bench/async_checkpoint.py                       # Llama 8 x 512, vocab 32k (~60M params)
    python bench/async_checkpoint.py --steps 30 --interval 10 --batch 2 --seq-len 64

One process, forja's model, AdamW (forja.optim) and the real CheckpointManager; the same seed
and batches for every run, `checkpoint.async_save = false` and `true` in alternating rounds
(sync then async, then async then sync, ...) so that a busy machine slows both alike. A training
step here is forward, backward, optimizer step and `poll()`; a save every `--interval` steps.
Reports, over all rounds:
  - the stall per save: how long `save()` blocked the loop (`last_blocking_s`; mean),
  - the median step time of steps during which a background write was in flight vs of the
    others (the write shares the CPU cores and memory bandwidth with training),
  - the total wall time of the steps, the last checkpoint's final `wait()` included (mean of rounds),
  - the time from a save's start to its finalization (`last_total_s`),
with async/sync ratios first. Checkpoints go to a temporary folder (keep = 1), removed after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.checkpoint.config import CheckpointConfig  # noqa: E402
from forja.checkpoint.manager import CheckpointManager  # noqa: E402
from forja.checkpoint.states import ModelState, OptimizerState  # noqa: E402
from forja.models import build_model  # noqa: E402
from forja.optim import build_optimizer  # noqa: E402
from forja.optim.config import OptimConfig  # noqa: E402
from forja.parallel.process_group import init_distributed, shutdown_distributed  # noqa: E402


@dataclass
class Run:
    stalls: list[float] = field(default_factory=list)  # seconds each save() blocked
    totals: list[float] = field(default_factory=list)  # seconds from each save's start to finalization
    busy_steps: list[float] = field(default_factory=list)  # steps with a background write in flight
    quiet_steps: list[float] = field(default_factory=list)  # steps with none
    walls: list[float] = field(default_factory=list)  # seconds of each run's steps, final wait() included

    def add(self, other: Run) -> None:
        for name in ("stalls", "totals", "busy_steps", "quiet_steps", "walls"):
            getattr(self, name).extend(getattr(other, name))


def model_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the checkpointed model and batch (what `build` reads), and --dir."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dir", default=None, help="where the temporary checkpoint folder goes (default: the system's)")
    return p


def build(args: argparse.Namespace):
    model = build_model("llama", "tiny", seed=0, dim=args.dim, n_layers=args.layers, ffn_dim=3 * args.dim,
                        vocab_size=args.vocab)
    optim = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4))
    return model, optim


def train_step(model, optim, tokens: torch.Tensor) -> None:
    optim.zero_grad()
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    optim.step()


def run(args: argparse.Namespace, async_save: bool, batches: list[torch.Tensor]) -> Run:
    model, optim = build(args)
    train_step(model, optim, batches[0])  # warm-up, untimed: AdamW's state exists from here on
    state = {"model": ModelState(model), "optim": OptimizerState(model, optim)}
    result = Run()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        manager = CheckpointManager(CheckpointConfig(async_save=async_save, keep=1), Path(folder))
        in_flight = False
        begin = time.perf_counter()
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            train_step(model, optim, batches[step % len(batches)])
            finalized = manager.poll()
            (result.busy_steps if in_flight else result.quiet_steps).append(time.perf_counter() - start)
            if finalized is not None:
                in_flight = False
                result.totals.append(manager.last_total_s)
            if step % args.interval == 0:
                manager.save(step, state)
                result.stalls.append(manager.last_blocking_s)
                in_flight = async_save
                if not async_save:
                    result.totals.append(manager.last_total_s)
        if manager.wait() is not None:  # the last checkpoint is complete only now
            result.totals.append(manager.last_total_s)
        result.walls.append(time.perf_counter() - begin)
    return result


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(args: argparse.Namespace, n_params: int, sync: Run, asyn: Run, load: str) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Llama dim {args.dim} x {args.layers} "
          f"layers, vocab {args.vocab} ({n_params / 1e6:.1f}M params, AdamW: {n_params * 12 / 1e6:.0f} MB "
          f"of state), {args.batch} x {args.seq_len} tokens, {args.steps} steps, a save every {args.interval}, "
          f"{args.rounds} rounds; load average {load}")
    print("| figure | sync | async | async/sync |\n|---|---:|---:|---:|")
    rows = [
        ("stall per save, s (mean)", mean(sync.stalls), mean(asyn.stalls)),
        ("total wall time of the steps, s (mean)", mean(sync.walls), mean(asyn.walls)),
        ("step time, no write in flight, s (median)", median(sync.quiet_steps), median(asyn.quiet_steps)),
        ("step time, write in flight, s (median)", median(sync.busy_steps), median(asyn.busy_steps)),
        ("save start to finalized, s (mean)", mean(sync.totals), mean(asyn.totals)),
    ]
    for name, s, a in rows:
        ratio = f"{a / s:.2f}x" if s > 0 and a > 0 else "-"  # false for nan: no such steps
        print(f"| {name} | {s:.3f} | {a:.3f} | {ratio} |")
    print(f"async: {len(asyn.busy_steps)} steps ran with a write in flight, {len(asyn.quiet_steps)} without; "
          f"their ratio (medians) {median(asyn.busy_steps) / median(asyn.quiet_steps):.2f}x")


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    init_distributed("cpu")
    try:
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen) for _ in range(4)]
        n_params = sum(p.numel() for p in build(args)[0].parameters())
        load_before = os.getloadavg()[0]
        sync, asyn = Run(), Run()
        for i in range(args.rounds):
            for async_save in ((False, True) if i % 2 == 0 else (True, False)):
                (asyn if async_save else sync).add(run(args, async_save, batches))
        report(args, n_params, sync, asyn, f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
