"""Each optimizer's best learning rate on the debug recipe: the defaults of DEFAULT_LR.

    python bench/optimizer_lr.py --dir runs/bench-optimizer-lr     # ~10 minutes on 2 CPU cores

Every trial is `configs/debug.toml` (the ~1M-parameter Llama `debug` on the stdlib corpus) for
STEPS steps at one learning rate, seed 0, scored by its final validation loss on VAL_BATCHES
batches. Each optimizer runs its grid of LRS; when its best is at an end of the grid, the grid is
extended one step (x3) past that end until the best is inside it, so a reported optimum is never
a grid edge. Trials run one after another in this process (no interpreter start per trial);
a trial whose run directory already holds its final validation is read back, not rerun, so a
killed bench resumes. Prints a Markdown table (the one in bench/RESULTS.md and docs/training.md)
and every loss tried.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from forja.files import read_records

STEPS = 40
VAL_BATCHES = 4
COMMON = [f"train.steps={STEPS}", f"train.val_interval={STEPS}", f"train.val_batches={VAL_BATCHES}",
          "checkpoint.interval=0", "train.sample_tokens=0", f"metrics.interval={STEPS}", "metrics.sinks=[\"jsonl\"]"]
# Starting grids, a factor ~3 apart, centred on each optimizer's usual range.
LRS = {
    "adamw": [1e-3, 3e-3, 1e-2, 3e-2],
    "adam": [1e-3, 3e-3, 1e-2, 3e-2],
    "sgd": [3e-2, 1e-1, 3e-1, 1.0],
    "adafactor": [3e-2, 1e-1, 3e-1, 1.0],
    "lion": [1e-4, 3e-4, 1e-3, 3e-3],
    "muon": [3e-3, 1e-2, 3e-2, 1e-1],
    "soap": [1e-3, 3e-3, 1e-2, 3e-2],
}
MAX_EXTENSIONS = 3  # a grid edge pushed this many times is reported as an edge


def final_val_loss(run_dir: Path) -> float | None:
    """The validation loss at the last step, when the trial finished; else None."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_records(path)
    vals = [r["val_loss"] for r in rows if "val_loss" in r and r.get("step") == STEPS]
    return vals[-1] if vals else None


def trial(root: Path, name: str, lr: float) -> float:
    from forja.config import load_config
    from forja.train.trainer import Trainer

    run_dir = root / f"{name}-lr{lr:g}"
    done = final_val_loss(run_dir)
    if done is not None:
        return done
    sets = COMMON + [f"run.dir={run_dir}", f"optim.name={name}", f"optim.lr={lr!r}", "run.start_over=true"]
    Trainer(load_config("debug", sets)).run()
    loss = final_val_loss(run_dir)
    if loss is None:
        raise RuntimeError(f"{run_dir} finished without a validation loss at step {STEPS}")
    return loss


def sweep(root: Path, name: str) -> tuple[dict[float, float], bool]:
    """lr -> final val loss, extended past an edge optimum; and whether the best is inside."""
    losses = {lr: trial(root, name, lr) for lr in LRS[name]}
    for _ in range(MAX_EXTENSIONS):
        lrs = sorted(losses)
        best = min(lrs, key=lambda lr: losses[lr] if losses[lr] == losses[lr] else float("inf"))
        if best not in (lrs[0], lrs[-1]):
            return losses, True
        nxt = best * 3 if best == lrs[-1] else best / 3
        losses[nxt] = trial(root, name, float(f"{nxt:.3g}"))
    return losses, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/bench-optimizer-lr"))
    parser.add_argument("--only", nargs="*", default=list(LRS), help="optimizers to sweep (default: all)")
    args = parser.parse_args()
    import torch

    # One thread: the 2-core machine is shared, and two threads fighting other processes
    # for the cores ran 10x slower than one thread that keeps its core.
    torch.set_num_threads(1)
    start = time.time()
    results = {}
    for name in args.only:
        results[name] = sweep(args.dir, name)
    print(f"\n{len(args.only)} optimizers, {sum(len(r[0]) for r in results.values())} trials, "
          f"{time.time() - start:.0f} s\n")
    print("| optimizer | best lr | final val loss | every lr tried: final val loss |")
    print("|---|---|---|---|")
    for name, (losses, inside) in results.items():
        best = min(losses, key=lambda lr: losses[lr] if losses[lr] == losses[lr] else float("inf"))
        tried = ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in sorted(losses.items()))
        print(f"| {name} | {best:g}{'' if inside else ' (grid edge)'} | {losses[best]:.4f} | {tried} |")


if __name__ == "__main__":
    main()
