"""DiLoCo and Streaming DiLoCo against plain DDP on the default recipe, 2 replicas each.

    python bench/diloco.py [--out runs/bench-diloco] [--steps 200] [--inner-steps 20]

Every run trains the same tokens: the recipe's global batch of 8 sequences per step, 4 per
replica. The baseline is DDP (`--nproc 2`, parallel.dp_replicate = 2): the gradients are
all-reduced every step. DiLoCo and Streaming DiLoCo run as 2 torchft replica groups of one rank
(`--ft-groups 2 --nproc 1`) that meet every ft.inner_steps (a fragment every
inner_steps / fragments). Reported: the final validation loss (the recipe's 4 validation batches)
and the bytes each replica hands to the collective between replicas per token trained. DDP's is
its gradients' bytes per step (every parameter once, fp32); DiLoCo's is counted by its outer loop
(`sync_bytes` in ft/group<g>/summary-rank0.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _train(run: Path, extra: list[str], sets: dict[str, str]) -> float:
    args = [sys.executable, "-m", "forja", "train", "default", "--start-over", *extra]
    for key, value in {"run.dir": json.dumps(str(run)), **sets}.items():
        args += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _result(run: Path, name: str, wall_s: float) -> dict:
    records = _records(run)
    val = [r for r in records if "val_loss" in r][-1]
    last = [r for r in records if "loss" in r][-1]
    summaries = [json.loads(p.read_text()) for p in sorted(run.glob("ft/group*/summary-rank0.json"))]
    out = {"run": name, "val_loss": val["val_loss"], "step": val["step"], "tokens": last["tokens_seen"],
           "wall_s": round(wall_s, 1)}
    if summaries:  # each group's bytes over its own tokens (half the run's)
        out |= {"sync_bytes": summaries[0]["sync_bytes"], "syncs": summaries[0]["syncs"],
                "bytes_per_token": summaries[0]["sync_bytes"] / (last["tokens_seen"] / len(summaries))}
    return out


def _ddp_bytes(ddp: dict, diloco: dict) -> None:
    """DDP all-reduces every gradient once per step: the model's fp32 bytes, which plain DiLoCo's
    outer loop counted at each of its syncs (it sends every parameter)."""
    model_bytes = diloco["sync_bytes"] / diloco["syncs"]
    ddp["bytes_per_token"] = model_bytes * ddp["step"] / (ddp["tokens"] / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-diloco")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--only", default=None, help="run only the runs whose name starts with this (then no table)")
    args = ap.parse_args()
    out = Path(args.out)
    base = {"train.steps": str(args.steps), "checkpoint.interval": str(args.steps)}
    h = str(args.inner_steps)
    runs = {
        "ddp": (["--nproc", "2"], {**base, "parallel.dp_replicate": "2", "parallel.dp_shard": "1"}),
        f"diloco H={h}": (["--ft-groups", "2", "--nproc", "1"],
                          {**base, "ft.mode": '"diloco"', "ft.inner_steps": h}),
        f"streaming-diloco H={h} F={args.fragments} delay=1": (
            ["--ft-groups", "2", "--nproc", "1"],
            {**base, "ft.mode": '"streaming-diloco"', "ft.inner_steps": h, "ft.fragments": str(args.fragments),
             "ft.fragment_sync_delay": "1"}),
        # Plain model averaging every H steps (outer SGD with lr 1 and no momentum: local SGD),
        # to tell what the outer Nesterov momentum does over so few outer steps.
        f"averaging H={h}": (["--ft-groups", "2", "--nproc", "1"],
                             {**base, "ft.mode": '"diloco"', "ft.inner_steps": h, "ft.outer_lr": "1.0",
                              "ft.outer_momentum": "0.0"}),
    }
    if args.only:
        runs = {k: v for k, v in runs.items() if k.startswith(args.only)}
    results = []
    for name, (extra, sets) in runs.items():
        run = out / name.split()[0]
        wall = _train(run, extra, sets)
        results.append(_result(run, name, wall))
        print(json.dumps(results[-1]), flush=True)
    if args.only:
        return
    ddp = results[0]
    _ddp_bytes(ddp, results[1])
    print("\n| run | final val loss | vs DDP | bytes per token between replicas | vs DDP | wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['val_loss']:.4f} | {r['val_loss'] - ddp['val_loss']:+.4f} | "
              f"{r['bytes_per_token']:,.0f} | {r['bytes_per_token'] / ddp['bytes_per_token']:.4f}x | {r['wall_s']} |")
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
