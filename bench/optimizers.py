"""Optimizers and muP on the default recipe, measured through `forja sweep`.

    python bench/optimizers.py --dir runs/bench-optim            # every phase (hours on 2 cores)
    python bench/optimizers.py --dir runs/bench-optim --report   # tables and plots only

Phases (each is a `forja sweep` directory, so a killed bench resumes where it stopped):
  1. lr: each optimizer over three learning rates, seed 0.
  2. mup: AdamW at widths 128/256/512 (FFN 3x, heads of 32; linked keys of one grid), standard
     vs muP (base width 128), over four learning rates: where the optimum sits at each width.
     forja sweep also writes each one's coords.png, the coordinate check.
  3. seeds: each optimizer at its best lr of phase 1, seeds 1 and 2 (seed 0 is reused).

Every trial is the default recipe (Llama `tiny`, the stdlib corpus) shortened by COMMON below so
that the whole bench fits a 2-core machine; the muP trials use 4 layers and 100 steps. Reports: the final
validation loss (mean, spread over seeds), the step at which Muon first reaches AdamW's final
loss (validation every 25 steps), the median time per step, and `mup.png`.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from forja.files import read_records

REPO = Path(__file__).resolve().parent.parent
RECIPE = str(REPO / "configs" / "default.toml")
COMMON = ["train.steps=150", "train.seq_len=128", "train.val_interval=25", "train.val_batches=4",
          "schedule.warmup_steps=15", "checkpoint.interval=50", "train.sample_tokens=0", "metrics.interval=5"]
LRS = {
    "adamw": ["1e-3", "3e-3", "1e-2"],
    "muon": ["3e-3", "1e-2", "3e-2"],
    "lion": ["1e-4", "3e-4", "1e-3"],
    "adafactor": ["3e-3", "1e-2", "3e-2"],
    "soap": ["1e-3", "3e-3", "1e-2"],
}
# When SOAP preconditioned every matrix, its default max_precond_dim (10,000) rotated the
# 8,192-token vocabulary side of the embeddings: an 8,192^2 eigendecomposition and 0.5 GB of
# factors each, 16 s a step here; this cap kept only the model's own matrices rotated. SOAP now
# leaves embeddings and the output to Adam (forja/optim/params.py), so on this model the cap
# changes nothing; it stays so that the recorded sweeps resume with their own config.
EXTRA = {"soap": ["optim.soap.max_precond_dim=1024"]}
# Where phase 1's best was the grid's largest lr, one more lr above it (run after the grids).
EDGE_LRS = {"lion": ["3e-3"], "adafactor": ["1e-1"]}
WIDTHS = [128, 256, 512]
MUP_LRS = ["1e-3", "3e-3", "1e-2", "3e-2"]
MUP_COMMON = ["model.overrides.n_layers=4", "train.steps=100", "schedule.warmup_steps=10"]
# Widening moves the residual stream, the MLP and the heads together (head_dim stays 32).
WIDTH_KEYS = "+".join(f"model.overrides.{k}" for k in ("dim", "ffn_dim", "n_heads", "n_kv_heads"))


def sweep(sweep_dir: Path, grids: list[str], common: list[str], parallel: int) -> None:
    cmd = [sys.executable, "-m", "forja", "sweep", RECIPE, "--dir", str(sweep_dir), "--parallel", str(parallel)]
    cmd += [a for g in grids for a in ("--grid", g)]
    cmd += [a for c in COMMON + common for a in ("--set", c)]
    subprocess.run(cmd, check=True)


def read_run(run_dir: Path) -> dict:
    """val loss by step and the median step time of one trial."""
    val, times = {}, []
    for rec in read_records(run_dir / "metrics.jsonl"):
        if "val_loss" in rec:
            val[rec["step"]] = rec["val_loss"]
        elif "step_time" in rec and rec["step"] > 10:  # the first steps warm up allocators
            times.append(rec["step_time"])
    return {"val": val, "final": val[max(val)], "step_time": statistics.median(times)}


def trials(sweep_dir: Path) -> list[tuple[dict, dict]]:
    """(values, run figures) of the sweep's finished trials; none when it has not started."""
    if not (sweep_dir / "sweep.json").is_file():
        return []
    state = json.loads((sweep_dir / "sweep.json").read_text())
    return [(t["values"], read_run(sweep_dir / t["name"])) for t in state["trials"] if t["status"] == "done"]


def lr_trials(root: Path, name: str) -> list[tuple[dict, dict]]:
    """Phase 1's trials of one optimizer (seed 0), the edge lr included."""
    return trials(root / f"lr-{name}") + trials(root / f"lr-{name}-edge")


def best_lrs(root: Path) -> dict[str, str]:
    best = {}
    for name in LRS:
        runs = lr_trials(root, name)
        if runs:  # optimizers whose sweep has not finished a trial are left out
            best[name] = min(runs, key=lambda r: r[1]["final"])[0]["optim.lr"]
    return best


def run_all(root: Path, parallel: int) -> None:
    for name, lrs in LRS.items():
        sweep(root / f"lr-{name}", [f"optim.lr={','.join(lrs)}"], [f"optim.name={name}", *EXTRA.get(name, [])],
              parallel)
    for name, lrs in EDGE_LRS.items():
        sweep(root / f"lr-{name}-edge", [f"optim.lr={','.join(lrs)}"], [f"optim.name={name}", *EXTRA.get(name, [])],
              parallel)
    widths = ",".join(f"{w}+{3 * w}+{w // 32}+{w // 64}" for w in WIDTHS)
    for mup in ("sp", "mup"):
        extra = ["model.mup_base_dim=128"] if mup == "mup" else []
        sweep(root / f"mup-{mup}", [f"{WIDTH_KEYS}={widths}", f"optim.lr={','.join(MUP_LRS)}"],
              MUP_COMMON + extra, parallel)
    # The seeds last: the muP figures need every trial, the seed spread is reported over what ran.
    for name, lr in best_lrs(root).items():
        sweep(root / f"seeds-{name}", ["train.seed=1,2"],
              [f"optim.name={name}", f"optim.lr={lr}", *EXTRA.get(name, [])],
              parallel)


def optimizer_table(root: Path) -> list[str]:
    best = best_lrs(root)
    lines = ["| optimizer | best lr | final val loss over seeds (mean ± sd) | median s/step | vs AdamW |",
             "|---|---|---|---|---|"]
    adamw_time = None
    for name, lr in best.items():
        seed0 = [r for v, r in lr_trials(root, name) if v["optim.lr"] == lr]
        runs = seed0 + [r for _, r in trials(root / f"seeds-{name}")]
        finals = [r["final"] for r in runs]
        step = statistics.median(r["step_time"] for r in runs)
        adamw_time = adamw_time or step
        spread = f" ± {statistics.stdev(finals):.4f}" if len(finals) > 1 else ""
        lines.append(f"| {name} | {lr} | {statistics.mean(finals):.4f}{spread} (n={len(finals)}) "
                     f"| {step:.3f} | {step / adamw_time:.2f}x |")
    lines += ["", "Every lr of phase 1 (seed 0), final val loss:", ""]
    for name in LRS:
        cells = ", ".join(f"{v['optim.lr']}: {r['final']:.4f}" for v, r in lr_trials(root, name))
        lines.append(f"- {name}: {cells}")
    return lines


def steps_to_reach(root: Path) -> list[str]:
    """Per seed: the first validation step at which Muon's loss is at or below AdamW's final loss."""
    best = best_lrs(root)

    def by_seed(name: str) -> dict[int, dict]:
        out = {0: next(r for v, r in lr_trials(root, name) if v["optim.lr"] == best[name])}
        out.update({int(v["train.seed"]): r for v, r in trials(root / f"seeds-{name}")})
        return out

    adamw, muon = by_seed("adamw"), by_seed("muon")
    lines = []
    for seed in sorted(set(adamw) & set(muon)):
        target, steps = adamw[seed]["final"], max(adamw[seed]["val"])
        hit = next((s for s in sorted(muon[seed]["val"]) if muon[seed]["val"][s] <= target), None)
        ratio = f"{steps / hit:.2f}x fewer" if hit else "not reached"
        lines.append(f"- seed {seed}: AdamW {target:.4f} at step {steps}; Muon reaches it at step {hit} ({ratio})")
    return lines


def mup_report(root: Path) -> list[str]:
    lines = ["| width | standard: best lr (loss) | muP: best lr (loss) |", "|---|---|---|"]
    curves: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for mup in ("sp", "mup"):
        for values, run in trials(root / f"mup-{mup}"):
            width = int(values[WIDTH_KEYS].split("+")[0])
            curves.setdefault((mup, width), []).append((float(values["optim.lr"]), run["final"]))
    for width in WIDTHS:
        cells = []
        for mup in ("sp", "mup"):
            points = curves.get((mup, width), [])
            lr, loss = min(points, key=lambda p: p[1]) if points else (float("nan"), float("nan"))
            cells.append(f"{lr:g} ({loss:.4f}, {len(points)} lrs)")
        lines.append(f"| {width} | {cells[0]} | {cells[1]} |")
    if curves:
        plot_mup({k: sorted(v) for k, v in curves.items()}, root / "mup.png")
    return lines


def plot_mup(curves: dict, path: Path) -> None:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4), layout="constrained")
    for i, (mup, title) in enumerate((("sp", "standard parametrization"), ("mup", "muP (base width 128)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for j, width in enumerate(WIDTHS):
            points = curves.get((mup, width))
            if not points:
                continue
            ax.plot(*zip(*points), "-o", color=f"C{j}", label=f"width {width}")
        ax.set(xscale="log", title=title, xlabel="AdamW lr", ylabel="final val loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("runs/bench-optim"))
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only print the tables from finished sweeps")
    args = p.parse_args()
    if not args.report:
        run_all(args.dir, args.parallel)
    print("\n".join(optimizer_table(args.dir) + [""] + steps_to_reach(args.dir) + [""] + mup_report(args.dir)))
    print(f"\nplot: {args.dir / 'mup.png'}")


if __name__ == "__main__":
    main()
