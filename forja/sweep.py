"""`forja sweep RECIPE --grid KEY=V1,V2,... [--random N --seed S] --dir SWEEP_DIR`: a
hyperparameter sweep made of ordinary runs.

Each trial is a run directory `<SWEEP_DIR>/trial-<k>-<slug>/` trained by `forja train` in a
child process (so a crashed trial cannot take the sweep down, and each trial resumes like
any run). `<SWEEP_DIR>/sweep.json` lists the trials, their values and their status
(pending, running, done, failed), rewritten atomically at every change; rerunning the same
command skips done trials and relaunches the rest. At the end (or with `--summary`) a table
ranks the trials by final validation loss and sweep.png plots it against the first swept key,
one line per value of the second; coords.png plots the activation sizes of each trial's first
validation the same way: over widths, with and without muP, that is the coordinate check.

Keys joined by '+' are swept together, their values joined the same way:
`--grid 'model.overrides.dim+model.overrides.ffn_dim=128+384,256+768'` widens a model's
residual stream and MLP at once (the x axis then reads the first part).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forja.config import load_config, parse_override
from forja.errors import ForjaError
from forja.files import read_records, write_atomic
from forja.host import threads_per_process

STATE = "sweep.json"
PLOT = "sweep.png"
COORDS_PLOT = "coords.png"
Grid = dict[str, list[str]]  # key -> its values, as TOML text for --set


# -- the trials ---------------------------------------------------------------------------------

def parse_grid(text: str) -> tuple[str, list[str]]:
    """'optim.lr=1e-3,3e-3' -> ('optim.lr', ['1e-3', '3e-3'])."""
    if "=" not in text:
        raise ForjaError(f"--grid {text!r} must look like section.key=V1,V2,..., e.g. optim.lr=1e-3,3e-3")
    key, raw = (s.strip() for s in text.split("=", 1))
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not key or not values:
        raise ForjaError(f"--grid {text!r} has an empty {'key' if not key else 'value list'}")
    linked = key.count("+") + 1
    bad = next((v for v in values if linked > 1 and v.count("+") + 1 != linked), None)
    if bad is not None:
        raise ForjaError(f"--grid {text!r} links {linked} keys, so each value needs {linked} parts joined by "
                         f"'+' (e.g. 256+768), but {bad!r} has {bad.count('+') + 1}")
    return key, values


def expand(key: str, value: str) -> list[tuple[str, str]]:
    """One grid entry as --set pairs: 'a.x+a.y', '1+2' (linked keys, swept together) -> a.x=1, a.y=2."""
    if "+" not in key:
        return [(key, value)]
    return list(zip(key.split("+"), value.split("+")))


def parse_grids(texts: list[str]) -> Grid:
    grid: Grid = {}
    for text in texts:
        key, values = parse_grid(text)
        if key in grid:
            raise ForjaError(f"--grid {key} is given twice; list all its values in one --grid")
        grid[key] = values
    if not grid:
        raise ForjaError("give at least one --grid section.key=V1,V2,...")
    return grid


def make_trials(grid: Grid, n_random: int | None, seed: int) -> list[dict[str, str]]:
    """The cartesian product of the grid, or `n_random` draws from it (reproducible from
    `seed`: the same command always names the same trials, which resuming relies on)."""
    keys = list(grid)
    if n_random is None:
        return [dict(zip(keys, combo)) for combo in itertools.product(*grid.values())]
    if n_random < 1:
        raise ForjaError(f"--random {n_random}: draw at least 1 trial")
    rng = random.Random(seed)
    return [{k: rng.choice(grid[k]) for k in keys} for _ in range(n_random)]


def trial_name(index: int, values: dict[str, str]) -> str:
    """'trial-0-lr=1e-3-dim=128': the last part of each key, characters safe in a path."""
    slug = "-".join(f"{'+'.join(p.rsplit('.', 1)[-1] for p in k.split('+'))}={v}" for k, v in values.items())
    slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", slug)[:60]
    return f"trial-{index}-{slug}"


def trial_overrides(sweep_dir: Path, trial: dict[str, Any], common: list[str]) -> list[str]:
    run_dir = json.dumps(str(sweep_dir / trial["name"]))
    pairs = [pair for k, v in trial["values"].items() for pair in expand(k, v)]
    return [f"run.dir={run_dir}", *(f"{k}={v}" for k, v in pairs), *common]


# -- sweep.json ---------------------------------------------------------------------------------

def new_state(recipe: str, grid: Grid, n_random: int | None, seed: int, common: list[str]) -> dict[str, Any]:
    trials = make_trials(grid, n_random, seed)
    return {"spec": {"recipe": recipe, "grid": grid, "random": n_random, "seed": seed, "set": common},
            "trials": [{"name": trial_name(i, v), "values": v, "status": "pending"}
                       for i, v in enumerate(trials)]}


def read_state(sweep_dir: Path) -> dict[str, Any] | None:
    path = sweep_dir / STATE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ForjaError(f"{path} is not valid JSON ({exc}); fix or delete it") from None


def save_state(sweep_dir: Path, state: dict[str, Any]) -> None:
    write_atomic(sweep_dir / STATE, json.dumps(state, indent=2) + "\n")


def resume_state(sweep_dir: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """The saved state when it is the same sweep, the fresh one when there is none; a
    different sweep in the same directory is refused (its trials would be mixed up)."""
    saved = read_state(sweep_dir)
    if saved is None:
        return fresh
    if saved.get("spec") != fresh["spec"]:
        old, new = saved.get("spec", {}), fresh["spec"]
        changed = next((k for k in new if old.get(k) != new[k]), "spec")
        raise ForjaError(f"{sweep_dir} holds another sweep (its {changed} differs: {old.get(changed)!r} "
                         f"there, {new[changed]!r} now); use another --dir")
    return saved


def check_configs(recipe: str, sweep_dir: Path, state: dict[str, Any], common: list[str]) -> None:
    """Load every trial's config before launching any, so a typo in a key or a value stops
    the sweep at once rather than failing every trial one after another."""
    for trial in state["trials"]:
        load_config(recipe, trial_overrides(sweep_dir, trial, common))


# -- launching ----------------------------------------------------------------------------------

def _child_env(parallel: int) -> dict[str, str]:
    """K trials at once share the machine's cores: each gets cores/K threads (unless the user
    set OMP_NUM_THREADS), so K trials do not oversubscribe the CPU and slow each other down."""
    return {**os.environ, **threads_per_process(parallel)}


def _launch(recipe: str, sweep_dir: Path, trial: dict[str, Any], common: list[str],
            parallel: int = 1) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "forja", "train", recipe]
    cmd += [a for o in trial_overrides(sweep_dir, trial, common) for a in ("--set", o)]
    logs = sweep_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Appended, so the log of a trial that was interrupted and relaunched keeps both launches.
    with open(logs / f"{trial['name']}.log", "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(parallel))


def run_trials(recipe: str, sweep_dir: Path, state: dict[str, Any], common: list[str], parallel: int,
               console: Console) -> None:
    """Train every trial that is not done, `parallel` at a time. On Ctrl-C or an error the
    children are stopped (forja train checkpoints on SIGTERM) and their trials stay
    'running', so the next launch resumes them."""
    todo = [t for t in state["trials"] if t["status"] != "done"]
    running: dict[str, tuple[dict[str, Any], subprocess.Popen]] = {}
    try:
        while todo or running:
            while todo and len(running) < parallel:
                trial = todo.pop(0)
                trial["status"] = "running"
                save_state(sweep_dir, state)
                console.print(f"training {trial['name']}", highlight=False)
                running[trial["name"]] = (trial, _launch(recipe, sweep_dir, trial, common, parallel))
            for name, (trial, proc) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                trial["status"] = "done" if proc.returncode == 0 else "failed"
                save_state(sweep_dir, state)
                console.print(f"{name}: {trial['status']} (exit code {proc.returncode})", highlight=False)
            time.sleep(0.2)
    finally:
        for _, proc in running.values():
            proc.terminate()
        for _, proc in running.values():
            proc.wait()


# -- the summary --------------------------------------------------------------------------------

def final_val_loss(run_dir: Path) -> float | None:
    """The last val_loss in the run's metrics.jsonl; a torn line (a killed run) is skipped."""
    losses = [float(r["val_loss"]) for r in read_records(run_dir / "metrics.jsonl")
              if isinstance(r.get("val_loss"), (int, float))]
    return losses[-1] if losses else None


def results(sweep_dir: Path, state: dict[str, Any]) -> list[tuple[dict[str, Any], float | None]]:
    """(trial, final validation loss) pairs, best first, trials without one last."""
    rows = [(t, final_val_loss(sweep_dir / t["name"]) if t["status"] == "done" else None)
            for t in state["trials"]]
    return sorted(rows, key=lambda r: (r[1] is None, r[1] if r[1] is not None else 0.0))


def summary_table(state: dict[str, Any], rows: list[tuple[dict[str, Any], float | None]]) -> Table:
    keys = list(state["spec"]["grid"])
    table = Table(title="sweep (best first)")
    for column in ("trial", *keys, "val loss"):
        table.add_column(column, justify="left" if column == "trial" else "right")
    for trial, loss in rows:
        shown = f"{loss:.4f}" if loss is not None else ("failed" if trial["status"] == "failed" else "—")
        table.add_row(trial["name"], *(trial["values"][k] for k in keys), shown)
    return table


def _number(text: str) -> float | None:
    """A grid value as a number for the x axis (a linked value by its first part), else None."""
    value = parse_override(f"x.v={text.split('+')[0]}")[1]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _draw(ax, state: dict[str, Any], values: dict[str, float], title: str, ylabel: str) -> None:
    """`values` (trial name -> figure) against the first swept key, one line per value of the second."""
    keys = list(state["spec"]["grid"])
    x_key, line_key = keys[0], (keys[1] if len(keys) > 1 else None)
    x_values = state["spec"]["grid"][x_key]
    numbers = [_number(v) for v in x_values]
    numeric = all(n is not None for n in numbers)
    position = dict(zip(x_values, numbers if numeric else range(len(x_values))))
    groups = state["spec"]["grid"][line_key] if line_key else [None]
    for i, group in enumerate(groups):
        points = sorted((position[t["values"][x_key]], values[t["name"]]) for t in state["trials"]
                        if t["name"] in values and (group is None or t["values"][line_key] == group))
        if points:
            label = f"{line_key} = {group}" if line_key else None
            ax.plot(*zip(*points), "-o", color=f"C{i % 10}", label=label)
    if numeric and min(numbers) > 0 and max(numbers) > 10 * min(numbers):
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(range(len(x_values)), x_values)
    ax.set(title=title, xlabel=x_key, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if line_key and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _figure(panels: int):
    try:
        from matplotlib.figure import Figure  # the object API: no global backend is changed
    except ImportError as exc:
        raise ForjaError("forja sweep draws with matplotlib: pip install 'forja[report]'") from exc
    fig = Figure(figsize=(8 * panels, 4.5), layout="constrained")
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _save(fig, path: Path) -> Path:
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    write_atomic(path, png.getvalue())
    return path


def plot_sweep(state: dict[str, Any], rows: list[tuple[dict[str, Any], float | None]], path: Path) -> Path:
    """Validation loss against the first swept key, one line per value of the second."""
    fig, (ax,) = _figure(1)
    _draw(ax, state, {t["name"]: loss for t, loss in rows if loss is not None}, "final validation loss", "val loss")
    return _save(fig, path)


def first_activation_sizes(run_dir: Path) -> tuple[int, dict[str, float]] | None:
    """(step, sizes) of the run's first validation that logged activation sizes."""
    for record in read_records(run_dir / "metrics.jsonl"):
        sizes = {k: v for k, v in record.items() if k.startswith("val_act_")}
        if sizes:
            return record["step"], sizes
    return None


def plot_coordinates(sweep_dir: Path, state: dict[str, Any], path: Path) -> Path | None:
    """The coordinate check (Yang et al. 2021): mean |activation| at each trial's first
    validation against the first swept key; under muP, swept over widths, its lines are flat."""
    found = {t["name"]: first_activation_sizes(sweep_dir / t["name"]) for t in state["trials"] if t["status"] == "done"}
    found = {name: f for name, f in found.items() if f is not None}
    if not found:
        return None
    names = sorted({k for _, sizes in found.values() for k in sizes})
    step = min(step for step, _ in found.values())
    fig, axes = _figure(len(names))
    for ax, name in zip(axes, names):
        values = {trial: sizes[name] for trial, (_, sizes) in found.items() if name in sizes}
        _draw(ax, state, values, f"{name} at step {step}: mean |x|", "mean |x|")
    return _save(fig, path)


def summarize(sweep_dir: Path, console: Console | None = None) -> Path:
    state = read_state(sweep_dir)
    if state is None:
        raise ForjaError(f"{sweep_dir / STATE} does not exist: start the sweep with a RECIPE and --grid")
    console = console or Console()
    rows = results(sweep_dir, state)
    console.print(summary_table(state, rows))
    path = plot_sweep(state, rows, sweep_dir / PLOT)
    console.print(f"wrote {path}", highlight=False)
    coords = plot_coordinates(sweep_dir, state, sweep_dir / COORDS_PLOT)
    if coords is not None:
        console.print(f"wrote {coords} (the coordinate check)", highlight=False)
    return path


# -- the command --------------------------------------------------------------------------------

def sweep(recipe: str, grids: list[str], sweep_dir: Path, *, n_random: int | None = None, seed: int = 0,
          common: list[str] = (), parallel: int = 1, console: Console | None = None) -> bool:
    """Run (or resume) a sweep; True when every trial is done."""
    if parallel < 1:
        raise ForjaError(f"--parallel {parallel}: run at least 1 trial at a time")
    common = list(common)
    for text in common:
        parse_override(text)  # a --set without '=' names itself, before anything else
    state = resume_state(sweep_dir, new_state(recipe, parse_grids(grids), n_random, seed, common))
    check_configs(recipe, sweep_dir, state, common)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    save_state(sweep_dir, state)
    console = console or Console()
    run_trials(recipe, sweep_dir, state, common, parallel, console)
    summarize(sweep_dir, console)
    return all(t["status"] == "done" for t in state["trials"])


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="train one run per point of a hyperparameter grid (resumable)",
                       description="Train a grid (or random draws) of hyperparameters, one run directory "
                                   "per trial; rerunning the same command resumes the sweep.")
    p.add_argument("config", nargs="?", default=None, metavar="RECIPE",
                   help="the recipe each trial trains (not needed with --summary)")
    p.add_argument("--grid", dest="grids", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="a swept key and its values (repeatable; the trials are the cartesian product); "
                        "keys joined by '+' move together: a.x+a.y=1+2,3+4")
    p.add_argument("--random", type=int, default=None, metavar="N",
                   help="instead of the whole product, N trials drawn from the grid's values")
    p.add_argument("--seed", type=int, default=0, help="the seed of --random's draws (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config value common to every trial (repeatable)")
    p.add_argument("--parallel", type=int, default=1, metavar="K", help="trials trained at once (default 1)")
    p.add_argument("--dir", required=True, metavar="SWEEP_DIR", help="where sweep.json and the trials go")
    p.add_argument("--summary", action="store_true", help="only print the table and write sweep.png")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.dir)
    if args.summary:
        summarize(sweep_dir)
        return 0
    if args.config is None:
        raise ForjaError("give the RECIPE to train (or --summary to only summarize an existing sweep)")
    done = sweep(args.config, args.grids, sweep_dir, n_random=args.random, seed=args.seed,
                 common=args.overrides, parallel=args.parallel)
    return 0 if done else 1
