"""What the checkpoint manifest (each file's size and CRC-32, forja/checkpoint/verify.py) costs.

    python bench/checkpoint_verify.py             # Llama 8 x 512, vocab 32k (~58M params) + AdamW

One process, the real CheckpointManager on the model and AdamW state of bench/async_checkpoint.py.
Saves with the manifest and without it (the hashing replaced by nothing: what a save cost
before) alternate round by round, sync and async, so that a busy machine slows both alike.
Reports the median, over rounds, of
  - the stall per save (`last_blocking_s`) and the time from a save's start to its
    finalization (`last_total_s`), with / without the manifest,
  - the time spent hashing itself (timed inside the save: less noisy on a busy machine than the
    difference of two save times), against the save without the manifest,
  - checking a checkpoint at load: sizes only, sizes + checksums, against loading it (dcp.load).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_checkpoint import build, model_parser, train_step  # noqa: E402

import forja.checkpoint.manager as manager_module  # noqa: E402
from forja.checkpoint.config import CheckpointConfig  # noqa: E402
from forja.checkpoint.manager import CheckpointManager  # noqa: E402
from forja.checkpoint.states import ModelState, OptimizerState  # noqa: E402
from forja.checkpoint.verify import damage  # noqa: E402
from forja.parallel.process_group import init_distributed, shutdown_distributed  # noqa: E402

HASHING = manager_module.digests
HASH_S: list[float] = []  # seconds each save spent in the hashing itself (its own thread for async)


def timed_hashing(folder, names):
    start = time.perf_counter()
    try:
        return HASHING(folder, names)
    finally:
        HASH_S.append(time.perf_counter() - start)


def timed_save(state: dict, folder: Path, step: int, *, async_save: bool, manifest: bool) -> tuple[float, float]:
    """(stall, start-to-finalized) seconds of one save."""
    manager_module.digests = timed_hashing if manifest else (lambda folder, names: {})
    try:
        manager = CheckpointManager(CheckpointConfig(async_save=async_save, keep=1), folder)
        manager.save(step, state)
        manager.wait()
        return manager.last_blocking_s, manager.last_total_s
    finally:
        manager_module.digests = HASHING


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = model_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    init_distributed("cpu")
    try:
        model, optim = build(args)
        train_step(model, optim, torch.randint(0, args.vocab, (args.batch, args.seq_len + 1)))  # AdamW state exists
        state = {"model": ModelState(model), "optim": OptimizerState(model, optim)}
        n_params = sum(p.numel() for p in model.parameters())
        figures: dict[tuple[str, bool], list[tuple[float, float]]] = {}
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            folder, step = Path(tmp), 0
            for i in range(args.rounds):
                for mode in ("sync", "async"):
                    for manifest in ((True, False) if i % 2 == 0 else (False, True)):
                        step += 1
                        figures.setdefault((mode, manifest), []).append(
                            timed_save(state, folder, step, async_save=mode == "async", manifest=manifest))
            step += 1
            timed_save(state, folder, step, async_save=False, manifest=True)
            ckpt = folder / f"step-{step:08d}"
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            checks = {"sizes": [], "checksums": [], "load": []}
            for _ in range(args.rounds):
                checks["sizes"].append(timed(lambda: damage(ckpt, checksums=False)))
                checks["checksums"].append(timed(lambda: damage(ckpt, checksums=True)))
                checks["load"].append(timed(lambda: dcp.load(state, checkpoint_id=str(ckpt))))
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Llama dim {args.dim} x {args.layers}, "
              f"vocab {args.vocab}: {n_params / 1e6:.1f}M params, checkpoint {size / 1e6:.0f} MB, {args.rounds} "
              f"rounds; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
        print("| save | figure | no manifest | manifest | ratio |\n|---|---|---:|---:|---:|")
        for mode in ("sync", "async"):
            for j, name in ((0, "stall per save, s"), (1, "save start to finalized, s")):
                off = statistics.median(f[j] for f in figures[(mode, False)])
                on = statistics.median(f[j] for f in figures[(mode, True)])
                print(f"| {mode} | {name} (median) | {off:.3f} | {on:.3f} | {on / off:.2f}x |")
        no_manifest = statistics.median(f[1] for f in figures[("sync", False)])
        hashing = statistics.median(HASH_S)
        print(f"hashing itself: {hashing:.3f} s per save (median of {len(HASH_S)}; all: "
              f"{', '.join(f'{t:.2f}' for t in HASH_S)}), {hashing / no_manifest:.3f}x of a sync save without it")
        load = statistics.median(checks["load"])
        print("| check at load | s (median) | against dcp.load |\n|---|---:|---:|")
        for name in ("sizes", "checksums"):
            t = statistics.median(checks[name])
            print(f"| {name} | {t:.4f} | {t / load:.3f}x of {load:.3f} s |")
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
