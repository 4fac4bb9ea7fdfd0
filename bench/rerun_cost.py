"""What the rerun of sampled steps costs (ft.rerun_interval, forja/train/step/rerun.py).

    python bench/rerun_cost.py [--out runs/bench-rerun] [--steps 30] [--recipe default]

Three runs of the recipe, the same steps and tokens: no rerun (the baseline), every step rerun
(ft.rerun_interval = 1: the cost of one sampled step) and every tenth. Reported: the median step
time of steps 3 onward (the first steps compile and warm the allocator), and its ratio to the
baseline's. Validation and checkpoints are off: only the steps are timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _mean_step_s(run: Path, recipe: str, steps: int, interval: int) -> float:
    sets = {"run.dir": json.dumps(str(run)), "train.steps": str(steps), "train.val_interval": "0",
            "checkpoint.enabled": "false", "ft.rerun_interval": str(interval), "metrics.interval": "1"}
    args = [sys.executable, "-m", "forja", "train", recipe, "--start-over"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.fmean(r["step_time"] for r in records if "loss" in r and r["step"] >= 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-rerun"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--recipe", default="default")
    args = p.parse_args()
    base = _mean_step_s(args.out / "off", args.recipe, args.steps, 0)
    print(f"| ft.rerun_interval | mean step (s) | vs no rerun |\n|---|---|---|\n| 0 (baseline) | {base:.3f} | 1.00 |")
    for interval in (1, 10):
        t = _mean_step_s(args.out / f"every{interval}", args.recipe, args.steps, interval)
        print(f"| {interval} | {t:.3f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
