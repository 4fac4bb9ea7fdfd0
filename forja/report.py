"""`forja report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a summary of training runs.

Reads each run's metrics.jsonl (written by the JSONL sink) and writes PNG charts, several
runs overlaid: loss.png (training loss, and validation loss dashed, on the same axes),
lr.png, tokens_per_sec.png and grad_norm.png. Then prints one summary row per run. The
charts go to the run directory for one run, to ./report for several, or to --out.

A mixture-of-experts run (its log holds the `moe/...` keys of forja/train/step/experts.py) also
gets expert_load.png, one panel each: the busiest expert's load over the mean and the load's
coefficient of variation; the CV of every MoE layer; and, when non-zero, the share of
token-slots dropped and the router losses. An "expert load" table then summarizes them. A run with downstream
evaluation in the loop
(`eval/<task>/<metric>` keys, forja/train/evaluation.py) gets eval.png: accuracy, normalized
accuracy and bits per byte of each task over steps. A run whose records carry the data
loader's keys (`stage`, `tokens/<source>`, `data/padding`, `data/cut_docs`; forja/data/load/loader.py)
gets data.png: the tokens each source has given, with each data stage's first step marked, and
the shares of padding and of cut documents.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table

from forja import metric_names as names
from forja.errors import ForjaError
from forja.files import read_records, write_atomic

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the run's name then comes from run.json or its directory
    tomllib = None

# chart file stem -> (title, metric keys drawn on it: the first solid, the second dashed)
CHARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    names.LOSS: ("loss (dashed: validation)", (names.LOSS, names.VAL_LOSS)),
    names.LR: ("learning rate", (names.LR,)),
    names.TOKENS_PER_SEC: ("tokens/s (all devices)", (names.TOKENS_PER_SEC,)),
    names.GRAD_NORM: ("gradient norm (before clipping)", (names.GRAD_NORM,)),
}

# expert_load.png: panel title -> metric keys (the first solid, the second dashed), drawn when
# logged; `LAYERS` stands for a panel of moe/layer{i}/load_cv, one line per MoE layer.
LAYERS = "per layer"
EXPERT_PANELS: dict[str, tuple[str, ...]] = {
    "expert load: busiest / mean, worst layer (dashed: CV, mean over layers)": (names.MOE_LOAD_MAX_MEAN,
                                                                                names.MOE_LOAD_CV),
    "load CV per MoE layer": (LAYERS,),
    "token-slots dropped by the capacity limit (share)": (names.MOE_DROPPED,),
    "router losses, unweighted: load balancing (dashed: z-loss)": (names.MOE_AUX_LOSS, names.MOE_Z_LOSS),
}
# Panels drawn only when some value is non-zero: dropless runs drop nothing, and a loss
# that is turned off is logged as 0.
WHEN_NONZERO = (names.MOE_DROPPED, names.MOE_AUX_LOSS, names.MOE_Z_LOSS)
_LAYER_CV = re.compile(names.moe_layer_pattern("load_cv"))


@dataclass
class Run:
    """One run's name and its metrics.jsonl records, in file order."""

    name: str
    path: Path
    records: list[dict]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """The (steps, values) at which `key` was logged with a value."""
        points = [(r["step"], r[key]) for r in self.records if r.get(key) is not None and "step" in r]
        return [s for s, _ in points], [v for _, v in points]

    def layer_cv_keys(self) -> list[str]:
        """The moe/layer{i}/load_cv keys logged, by layer index."""
        found = {m.group(0): int(m.group(1)) for r in self.records for k in r if (m := _LAYER_CV.fullmatch(k))}
        return sorted(found, key=found.get)

    def panel_keys(self, keys: tuple[str, ...]) -> list[str]:
        """The keys of an EXPERT_PANELS entry this run has something to draw for."""
        if keys == (LAYERS,):
            return self.layer_cv_keys()
        drawn = [k for k in keys if self.series(k)[0]]
        return [k for k in drawn if k not in WHEN_NONZERO or any(v != 0 for v in self.series(k)[1])]


def run_name(run_dir: Path) -> str:
    """The name in run.json or config.toml if either gives one, else the directory's name."""
    try:
        meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
        name = meta.get("name") or meta.get("run_name")
        if isinstance(name, str) and name:
            return name
    except (OSError, ValueError, AttributeError):
        pass
    try:
        if tomllib is None:
            raise OSError("no TOML reader")
        config = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
        name = config.get("name") or config.get("run", {}).get("name")
        if isinstance(name, str) and name:
            return name
    except (OSError, ValueError, AttributeError):
        pass
    return run_dir.resolve().name


def load_run(run_dir: str | os.PathLike[str]) -> Run:
    """Read a run directory's metrics.jsonl; a torn last line (a run that died) is skipped."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ForjaError(f"{path} does not exist; give a run directory that forja train wrote "
                         "with the jsonl metrics sink (metrics.sinks includes \"jsonl\")")
    records = read_records(path, strict=True)
    if not any("step" in r for r in records):
        raise ForjaError(f"{path} holds no metrics yet; report on it once the run has logged a step")
    return Run(name=run_name(run_dir), path=run_dir, records=records)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def train_seconds(run: Run) -> float | None:
    """Time spent in training steps: each log's mean step time times the steps it covers.
    Without step times, the span of the log's timestamps."""
    total, previous, timed = 0.0, 0, False
    for r in run.records:
        if r.get(names.STEP_TIME) is not None:
            total += r[names.STEP_TIME] * max(r["step"] - previous, 0)
            previous, timed = r["step"], True
    if timed:
        return total
    stamps = [r["time"] for r in run.records if isinstance(r.get("time"), (int, float))]
    return max(stamps) - min(stamps) if len(stamps) > 1 else None


def summarize(run: Run) -> dict[str, float | int | None]:
    """steps, final_loss, best_val_loss, last_val_loss, mean_tokens_per_sec, mean_mfu, train_seconds,
    goodput (of the run's last end, None before one), and the health events (rollbacks,
    skipped steps, stragglers named)."""
    _, loss = run.series(names.LOSS)
    _, val = run.series(names.VAL_LOSS)
    steps = [r["step"] for r in run.records if "step" in r]
    return {
        "steps": max(steps),
        "final_loss": loss[-1] if loss else None,
        "best_val_loss": min(val) if val else None,
        "last_val_loss": val[-1] if val else None,
        "mean_tokens_per_sec": _mean(run.series(names.TOKENS_PER_SEC)[1]),
        "mean_mfu": _mean(run.series(names.MFU)[1]),
        "train_seconds": train_seconds(run),
        "goodput": (run.series("goodput")[1] or [None])[-1],
        "restarts": (run.series("restarts")[1] or [0])[-1],
        **health_events(run),
    }


def health_events(run: Run) -> dict[str, int]:
    """How often the run rolled back, skipped a step, or named a straggler (its "event" records)."""
    actions = [(r["event"], r.get("action")) for r in run.records if "event" in r]
    return {"rollbacks": sum(a == "rollback" for _, a in actions), "skipped": sum(a == "skip" for _, a in actions),
            "stragglers": sum(e == "straggler" for e, _ in actions)}


def _save(fig, path: Path) -> None:
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    write_atomic(path, png.getvalue())


def plot(runs: list[Run], out_dir: Path) -> list[Path]:
    """Write the charts of CHARTS that any run has data for; return their paths."""
    # The object API, not pyplot: draws with Agg and changes no global backend.
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ForjaError("forja report draws with matplotlib: pip install 'forja[report]'") from exc

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, keys) in CHARTS.items():
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.add_subplot()
        drawn = False
        for i, run in enumerate(runs):
            color = f"C{i % 10}"
            for key, style in zip(keys, ("-", "--")):
                steps, values = run.series(key)
                if steps:
                    label = run.name if key == keys[0] else f"{run.name} ({key})"
                    ax.plot(steps, values, style, color=color, label=label, marker="o" if len(steps) < 3 else None)
                    drawn = True
        if not drawn:
            continue
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / f"{stem}.png"
        _save(fig, path)
        written.append(path)
    extra = [plot(runs, out_dir, Figure) for plot in (plot_expert_load, plot_eval, plot_data)]
    return written + [path for path in extra if path]


# The in-loop evaluation's figures drawn in eval.png, one panel each (forja/train/evaluation.py).
EVAL_METRICS = ("acc", "acc_norm", "bits_per_byte")


def eval_keys(runs: list[Run]) -> list[str]:
    """The eval/<task>/<metric> keys of EVAL_METRICS that any run logged, in a stable order."""
    found = {k for run in runs for r in run.records for k in r
             if k.startswith("eval/") and k.rsplit("/", 1)[-1] in EVAL_METRICS}
    return sorted(found)


def plot_eval(runs: list[Run], out_dir: Path, Figure) -> Path | None:
    """eval.png: each downstream figure over steps, a panel per task and metric; None without any."""
    keys = eval_keys(runs)
    if not keys:
        return None
    fig = Figure(figsize=(8, 2.6 * len(keys)), layout="constrained")
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys):
        for i, run in enumerate(runs):
            _plot_line(ax, run.series(key), "-", f"C{i % 10}", run.name)
        ax.set(title=key.removeprefix("eval/"))
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1].set(xlabel="step")
    path = out_dir / "eval.png"
    _save(fig, path)
    return path


def stage_starts(run: Run) -> list[tuple[int, int]]:
    """(step, stage) where each data stage after the first begins in the run's records."""
    steps, stages = run.series("stage")
    return [(s, int(k)) for i, (s, k) in enumerate(zip(steps, stages)) if i and k != stages[i - 1]]


def plot_data(runs: list[Run], out_dir: Path, Figure) -> Path | None:
    """data.png: tokens per source over steps (stage starts dotted), padding and cut documents;
    None when no run logged per-source tokens."""
    sources = sorted({k for run in runs for r in run.records for k in r if k.startswith("tokens/")})
    if not sources:
        return None
    fig = Figure(figsize=(8, 6), layout="constrained")
    tokens, shares = fig.subplots(2, 1, sharex=True)
    for i, run in enumerate(runs):
        for j, key in enumerate(sources):
            style = ("-", "--", ":", "-.")[i % 4]
            _plot_line(tokens, run.series(key), style, f"C{j % 10}", f"{run.name}: {key.removeprefix('tokens/')}")
        for step, stage in stage_starts(run):
            tokens.axvline(step, color="grey", linestyle=":", linewidth=1)
            tokens.annotate(f"stage {stage}", (step, 1), xycoords=("data", "axes fraction"), fontsize=8,
                            va="top", ha="left")
        for key, style, label in share_lines(run):
            _plot_line(shares, run.series(key), style, f"C{i % 10}", label)
    notes = [note for run in runs for note in flat_notes(run)]
    if notes:  # a line that never moves says less than a sentence
        shares.annotate("\n".join(notes), (0.01, 0.03), xycoords="axes fraction", fontsize=8, va="bottom")
    tokens.set(title="tokens given by each source (dotted: a data stage begins)", ylabel="tokens")
    shares.set(title="share of padding (solid) and of documents cut (dashed)", xlabel="step", ylim=(0, 1.05))
    for ax in (tokens, shares):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # every share flat: notes only, no legend
            ax.legend(fontsize=8)
    path = out_dir / "data.png"
    _save(fig, path)
    return path


SHARES = (("data/padding", "-", "padding"), ("data/cut_docs", "--", "documents cut"))


def share_lines(run: Run) -> list[tuple[str, str, str]]:
    """(key, line style, label) of data.png's shares that change over the run; a share that
    stays put (documents cut = 1.0 at every step under window packing, which cuts every
    document longer than a window by design) is said in a note instead (`flat_notes`)."""
    return [(key, style, f"{run.name}: {what}") for key, style, what, values in _shares(run)
            if max(values) - min(values) > _FLAT]


def flat_notes(run: Run) -> list[str]:
    """One sentence per share that stays put over the run."""
    notes = []
    for key, _, what, values in _shares(run):
        if max(values) - min(values) <= _FLAT:
            cut_all = key == "data/cut_docs" and values[0] > 0.99
            why = " (window packing cuts documents at the windows' edges)" if cut_all else ""
            notes.append(f"{run.name}: {what} {values[0]:.0%} at every step{why}")
    return notes


_FLAT = 1e-9


def _shares(run: Run) -> list[tuple[str, str, str, list[float]]]:
    """(key, line style, what, values) of each share the run logged."""
    return [(key, style, what, values) for key, style, what in SHARES if (values := run.series(key)[1])]


def expert_panels(runs: list[Run]) -> dict[str, dict[str, list[str]]]:
    """Panel title -> run name -> the keys drawn for it, for the panels with something to draw."""
    panels = {title: {run.name: run.panel_keys(keys) for run in runs} for title, keys in EXPERT_PANELS.items()}
    return {title: {name: keys for name, keys in by_run.items() if keys}
            for title, by_run in panels.items() if any(by_run.values())}


def plot_expert_load(runs: list[Run], out_dir: Path, Figure) -> Path | None:
    """expert_load.png when any run logged expert-load metrics, one panel per EXPERT_PANELS
    entry with data, sharing the step axis; None for dense runs."""
    panels = expert_panels(runs)
    if not panels:
        return None
    fig = Figure(figsize=(8, 3 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, by_run) in zip(axes, panels.items()):
        layers = EXPERT_PANELS[title] == (LAYERS,)
        for i, run in enumerate(runs):
            keys = by_run.get(run.name, [])
            if layers:
                _plot_layers(ax, run, keys, ("-", "--", ":", "-.")[i % 4], len(runs) > 1, _layer_norm(by_run))
                continue
            for key in keys:
                style = "-" if key == EXPERT_PANELS[title][0] else "--"
                _plot_line(ax, run.series(key), style, f"C{i % 10}", f"{run.name} ({key})")
        ax.set(title=title)
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) <= 12:
            ax.legend(fontsize="small")
        elif layers:  # a legend of 48 layers would hide the lines: a colour scale instead
            from matplotlib.cm import ScalarMappable

            fig.colorbar(ScalarMappable(_layer_norm(by_run), "viridis"), ax=ax, label="layer")
    axes[-1].set(xlabel="step")
    path = out_dir / "expert_load.png"
    _save(fig, path)
    return path


def _plot_line(ax, series: tuple[list[int], list[float]], style: str, color, label: str) -> None:
    steps, values = series
    ax.plot(steps, values, style, color=color, label=label, marker="o" if len(steps) < 3 else None)


def _layer_norm(by_run: dict[str, list[str]]):
    """Layer index -> [0, 1] over the layers any run logged, for the colour scale."""
    from matplotlib.colors import Normalize

    indices = [int(_LAYER_CV.fullmatch(k).group(1)) for keys in by_run.values() for k in keys]
    return Normalize(min(indices), max(max(indices), min(indices) + 1))


def _plot_layers(ax, run: Run, keys: list[str], style: str, several: bool, norm) -> None:
    """One line per layer, coloured along viridis by layer index (one colour scale for a
    48-layer model); several runs differ by line style."""
    from matplotlib import colormaps

    for key in keys:
        layer = int(_LAYER_CV.fullmatch(key).group(1))
        label = f"{run.name} layer {layer}" if several else f"layer {layer}"
        _plot_line(ax, run.series(key), style, colormaps["viridis"](norm(layer)), label)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_table(runs: list[Run]) -> Table:
    table = Table(title="training runs")
    for column in ("run", "steps", "final loss", "best val loss", "last val loss", "mean tokens/s",
                   "mean MFU", "train time"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=column == "run")
    for run in runs:
        s = summarize(run)
        seconds = s["train_seconds"]
        table.add_row(run.name, str(s["steps"]), _fmt(s["final_loss"], ".4f"), _fmt(s["best_val_loss"], ".4f"),
                      _fmt(s["last_val_loss"], ".4f"), _fmt(s["mean_tokens_per_sec"], ",.0f"),
                      "n/a" if s["mean_mfu"] is None else f"{100 * s['mean_mfu']:.1f}%",
                      "n/a" if seconds is None else str(timedelta(seconds=round(seconds))))
    return table


def health_table(runs: list[Run]) -> Table | None:
    """Goodput, restarts and health events of the runs that have any (None if none has)."""
    rows = [(run.name, summarize(run)) for run in runs]
    rows = [(name, s) for name, s in rows if s["goodput"] is not None or s["rollbacks"] or s["skipped"]
            or s["stragglers"]]
    if not rows:
        return None
    table = Table(title="run health")
    for column in ("run", "goodput", "restarts", "rollbacks", "skipped steps", "stragglers named"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=column == "run")
    for name, s in rows:
        table.add_row(name, "n/a" if s["goodput"] is None else f"{100 * s['goodput']:.1f}%", str(s["restarts"]),
                      str(s["rollbacks"]), str(s["skipped"]), str(s["stragglers"]))
    return table


def expert_table(runs: list[Run]) -> Table | None:
    """Last values of each MoE run's expert-load metrics (the worst dropped share); None
    when no run has any."""
    moe_runs = [run for run in runs if run.series(names.MOE_LOAD_MAX_MEAN)[0]]
    if not moe_runs:
        return None
    table = Table(title="expert load")
    for column in ("run", "MoE layers", "load max/mean", "load CV", "dropped (max)", "aux loss", "z-loss"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=column == "run")
    for run in moe_runs:
        last = {key: (run.series(key)[1] or [None])[-1] for key in (names.MOE_LOAD_MAX_MEAN, names.MOE_LOAD_CV,
                                                                     names.MOE_AUX_LOSS, names.MOE_Z_LOSS)}
        dropped = run.series(names.MOE_DROPPED)[1]
        table.add_row(run.name, str(len(run.layer_cv_keys())), _fmt(last[names.MOE_LOAD_MAX_MEAN], ".3f"),
                      _fmt(last[names.MOE_LOAD_CV], ".3f"), _fmt(max(dropped) if dropped else None, ".2%"),
                      _fmt(last[names.MOE_AUX_LOSS], ".4f"), _fmt(last[names.MOE_Z_LOSS], ".4f"))
    return table


def report(run_dirs: list[str | os.PathLike[str]], out_dir: str | os.PathLike[str] | None = None,
           console: Console | None = None) -> list[Path]:
    """Charts and a summary of `run_dirs`; returns the chart paths. Every run is read (and
    checked) before anything is written."""
    if not run_dirs:
        raise ForjaError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    for run in runs:  # two runs of the same name: tell them apart by their path
        if names.count(run.name) > 1:
            run.name = str(run.path)
    out = Path(out_dir) if out_dir is not None else (Path(run_dirs[0]) if len(runs) == 1 else Path("report"))
    written = plot(runs, out)
    console = console or Console()
    console.print(summary_table(runs))
    health = health_table(runs)
    if health is not None:
        console.print(health)
    experts = expert_table(runs)
    if experts is not None:
        console.print(experts)
    for path in written:  # whole on one line, to copy, however narrow the terminal
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    return written


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plot and summarize training runs",
                       description="Plot loss, validation loss, learning rate, tokens/s and gradient norm of "
                                   "one or more runs (overlaid), and the expert load of mixture-of-"
                                   "experts runs, and print a summary of each.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write the PNGs (default: the run directory for one run, ./report for several)")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    report(args.run_dirs, args.out)
    return 0
