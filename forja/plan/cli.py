"""`forja plan`: the layouts of a recipe on N devices, predicted and ranked; one given layout
(`--layout`); or a finished run's measurements against the prediction (`--check RUN_DIR`)."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from forja.errors import ForjaError
from forja.files import read_records

GB = 1e9


def add_cli(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="predict memory and speed of every parallel layout; pick the best",
                       description="Predict per-rank peak memory, step time, tokens/s and MFU of the layouts "
                                   "of a recipe on N devices, rank those that fit, and say why the others don't.")
    p.add_argument("config", nargs="?", default=None, metavar="RECIPE", help="the recipe (not needed with --check)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value of the recipe, as for forja train (repeatable)")
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="devices (ranks) of the job")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="default: the hardware table's")
    p.add_argument("--gpu", default=None, metavar="KIND",
                   help="a kind of forja/plan/hardware.toml (default h100; with --check, the run's own device)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="the device's memory in GiB as it reports it (nvidia-smi's total MiB / 1024)")
    p.add_argument("--top", type=int, default=10, metavar="K",
                   help="the K fastest layouts that run and fit (default 10)")
    p.add_argument("--wide", action="store_true",
                   help="spell the layouts out, print every key of the best, and say why the others do not fit "
                        "or run (about 200 columns)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--layout", default=None, metavar="KEY=V,...",
                   help="hold these keys and search the rest, e.g. 'parallel.dp_shard=2,parallel.ac=full' "
                        "(values read as --set reads them; give every degree and option to predict one layout)")
    p.add_argument("--check", default=None, metavar="RUN_DIR",
                   help="compare a finished run's peak memory and tokens/s with the prediction for its layout")
    add_goodput_args(p)
    p.set_defaults(func=_run_cli)
    return p  # forja/train/rehearse/cli.py adds --rehearse (it runs training code, which plan never imports)


def add_goodput_args(p: argparse.ArgumentParser) -> None:
    """--goodput and the failure model's inputs (forja/plan/goodput.py); unset ones take the
    recipe's values (with a RECIPE and --gpus) or the model's defaults."""
    g = p.add_argument_group("goodput under failures", "restart-the-job against torchft replica groups and "
                             "DiLoCo (docs/planner.md, \"Goodput under failures\")")
    g.add_argument("--goodput", nargs="?", const="8,64,512,4096,16384", default=None, metavar="N,N,...",
                   help="print each policy's goodput for these job sizes (default 8,64,512,4096,16384, and "
                        "--gpus); no RECIPE needed")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--failure-rate", type=float, default=None, metavar="F",
                      help="failures per GPU-hour (default 1.97e-5, Llama 3's 16K-GPU run)")
    rate.add_argument("--mtbf-hours", type=float, default=None, metavar="H",
                      help="or one GPU's mean time between failures")
    for flag, key, kind, what in (
            ("--step-time", "step_s", float, "S: the step's seconds (default: the best layout's, or 2)"),
            ("--checkpoint-interval", "checkpoint_interval", int,
             "STEPS: steps between saves (default: the recipe's, or 500)"),
            ("--checkpoint-save-s", "checkpoint_save_s", float, "S: seconds a save blocks training (default 30)"),
            ("--restart-s", "restart_s", float, "S: a whole job's relaunch and checkpoint load (default 300)"),
            ("--group-gpus", "group_gpus", int, "M: GPUs of a replica group (default: a node)"),
            ("--heal-s", "heal_s", float, "S: a failed group's restart and heal (default 120 + the copy)"),
            ("--inner-steps", "inner_steps", int, "H: DiLoCo's steps between syncs (default: ft.inner_steps)"),
            ("--sync-s", "sync_s", float, "S: one DiLoCo sync's all-reduce (default: from the model's size, or 0.2)")):
        g.add_argument(flag, dest=f"goodput_{key}", type=kind, default=None, metavar=what.split(":")[0],
                       help=what.split(": ", 1)[1])


def failure_model(args: argparse.Namespace, base=None):
    """The failure model of the flags given, over `base` (the recipe's, or the defaults)."""
    from dataclasses import fields, replace

    from forja.plan.goodput import FailureModel

    given = {f.name: getattr(args, f"goodput_{f.name}") for f in fields(FailureModel)
             if getattr(args, f"goodput_{f.name}", None) is not None}
    if args.mtbf_hours is not None:
        if not args.mtbf_hours > 0:
            raise ForjaError(f"--mtbf-hours {args.mtbf_hours}: give a mean time between failures > 0 hours")
        given["failure_rate"] = 1 / args.mtbf_hours
    elif args.failure_rate is not None:
        given["failure_rate"] = args.failure_rate
    return replace(base or FailureModel(), **given)


def goodput_sizes(args: argparse.Namespace) -> list[int]:
    try:
        sizes = {int(n) for n in args.goodput.split(",")} | ({args.gpus} if args.gpus else set())
    except ValueError:
        raise ForjaError(f"--goodput {args.goodput}: give job sizes as GPU counts, e.g. 8,64,512") from None
    if min(sizes) < 1:
        raise ForjaError(f"--goodput {args.goodput}: every job size needs at least 1 GPU")
    return sorted(sizes)


def print_goodput(m, rows: list[dict]) -> None:
    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"goodput at {m.failure_rate:.3g} failures per GPU-hour: step {m.step_s:.3g} s, a save every "
                        f"{m.checkpoint_interval} steps ({m.checkpoint_save_s:g} s), restart {m.restart_s:g} s; "
                        f"groups of {m.group_gpus} GPUs, heal {m.heal_s:.3g} s; DiLoCo H={m.inner_steps}, "
                        f"sync {m.sync_s:.3g} s", title_justify="left")
    for col in ("GPUs", "groups", "failures/day", "restart", "Young interval", "restart at Young", "ft groups",
                "DiLoCo", "DiLoCo tokens/s x"):
        table.add_column(col, justify="right")
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    for r in rows:
        table.add_row(f"{r['gpus']:,}", f"{r['groups']:,}", f"{r['job_failures_per_day']:.3g}", pct(r["restart"]),
                      f"{r['young_interval_steps']:,}", pct(r["restart_at_young"]), pct(r["ft"]), pct(r["diloco"]),
                      "-" if r["diloco_throughput"] is None else f"{r['diloco_throughput']:.3f}")
    console.print(table)
    console.print("goodput: committed training / wall time, each policy at its own failure-free speed; the last "
                  "column: DiLoCo's tokens/s against the synchronous job without failures; '-': one group",
                  highlight=False)


def hardware_for(args: argparse.Namespace):
    from dataclasses import replace

    from forja.plan.hardware import get_hardware

    hw = get_hardware(args.gpu or "h100", memory_gib=args.gpu_memory)
    return replace(hw, gpus_per_node=args.gpus_per_node) if args.gpus_per_node else hw


def _run_cli(args: argparse.Namespace) -> int:
    if args.check:
        return check_run(Path(args.check), args)
    if args.goodput is not None and args.config is None:
        return goodput_cli(args, failure_model(args))
    cfg, hw, job, candidates = planned(args)
    if args.goodput is not None:
        from forja.plan.goodput import recipe_model

        step = candidates[0].time.total or 2.0  # an unknown peak predicts no time: the default
        return goodput_cli(args, failure_model(args, recipe_model(cfg, job, step, hw)), candidates, hw, job)
    if args.json:
        from forja.plan.planner import usable_memory

        print(json.dumps({"hardware": hw.kind, "gpus": args.gpus, "params": job.shape.n_params,
                          "usable_memory_bytes": round(usable_memory(hw)),
                          "candidates": [c.as_json() for c in candidates]}, indent=1))
        return 0
    print_plan(candidates, hw, args.gpus, args.top, job, wide=args.wide, base=(args.config, args.overrides, cfg))
    return 0


def planned(args: argparse.Namespace):
    """The recipe, hardware, job and ranked candidates of `forja plan RECIPE --gpus N [--layout]`."""
    from forja.config import load_config
    from forja.plan.job import job_from_config
    from forja.plan.layout import parse_fixed
    from forja.plan.planner import default_space, plan

    if args.config is None or args.gpus is None:
        raise ForjaError("forja plan needs a RECIPE and --gpus N (or --check RUN_DIR, or --goodput)")
    if args.gpus < 1:
        raise ForjaError(f"--gpus {args.gpus}: give at least 1 device")
    cfg = load_config(args.config, args.overrides)
    hw = hardware_for(args)
    job = job_from_config(cfg, gpu=hw.kind != "cpu")
    space = default_space(hw)
    if args.layout is not None:  # a partial layout: the keys given are held, the rest searched
        space = space.with_fixed(parse_fixed(args.layout))
    candidates = plan(job, hw, args.gpus, space=space)
    if not candidates:
        held = f" with {args.layout}" if args.layout else ""
        raise ForjaError(f"no layout of {args.gpus} ranks{held} divides this job (global batch "
                         f"{job.global_batch_size}, {job.args.n_heads} heads, {job.args.n_kv_heads} KV heads, "
                         f"{job.args.n_layers} layers); change --gpus or the keys held")
    return cfg, hw, job, candidates


def goodput_cli(args: argparse.Namespace, m, candidates=None, hw=None, job=None) -> int:
    """--goodput: the table, after the plan's when a recipe was planned; --json: one object."""
    from dataclasses import asdict

    from forja.plan.goodput import table

    rows = table(m, goodput_sizes(args))
    if args.json:
        out = {"goodput": {"model": asdict(m), "rows": rows}}
        if candidates is not None:
            out |= {"hardware": hw.kind, "gpus": args.gpus, "params": job.shape.n_params,
                    "candidates": [c.as_json() for c in candidates]}
        print(json.dumps(out, indent=1))
        return 0
    if candidates is not None:
        print_plan(candidates, hw, args.gpus, args.top, job, wide=args.wide)
    print_goodput(m, rows)
    return 0


def set_items(layout) -> list[str]:
    """The `--set` values (KEY=VALUE) that select `layout` in forja train."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in layout.overrides().items()]


def set_line(layout) -> str:
    """The `--set` arguments that select `layout` in forja train."""
    return " ".join(f"--set {item}" for item in set_items(layout))


def changed_items(layout, cfg) -> list[str]:
    """The `--set` values (KEY=VALUE) of `layout` that differ from `cfg`'s: what to add to the
    recipe's command line to run it."""
    values = layout.overrides()
    return [item for (key, value), item in zip(values.items(), set_items(layout))
            if getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) != value]


def train_lines(recipe: str, overrides: list[str], items: list[str], width: int = 100) -> list[str]:
    """`forja train RECIPE --set ...` as shell lines of at most `width` columns, each but the
    last ending in a backslash: pasted whole, one command."""
    keys = {i.split("=")[0] for i in items}  # the layout's value of a key replaces the user's
    kept = [o for o in overrides if o.split("=")[0].strip() not in keys]
    words = [f"forja train {shlex.quote(recipe)}"] + [f"--set {shlex.quote(i)}" for i in [*kept, *items]]
    lines, line = [], ""
    for word in words:
        if line and len(line) + len(word) + 3 > width:
            lines.append(line + " \\")
            line = "   "
        line += (" " if line.strip() else "") + word
    return lines + [line]


def print_plan(candidates, hw, gpus: int, top: int, job, console: Console | None = None, *, wide: bool = False,
               base: tuple[str, list[str], object] | None = None) -> None:
    """The table of the `top` fastest layouts that run and fit, a line counting the rest, and the
    best one as the `forja train` command to run it (`base`: the recipe, its --set values and its
    config; without it, the --set line alone). At most 100 columns, unless `wide` (the layouts
    spelled out, every key on one line, and why the others do not fit or run)."""
    from forja.plan.planner import usable_memory

    console = console or Console(width=None if sys.stdout.isatty() and not wide else 100 + 100 * wide)
    fits = [c for c in candidates if c.fits]
    usable = usable_memory(hw) / GB
    console.print(f"{job.shape.n_params / 1e9:.2f}B parameters on {gpus} x {hw.name} ({usable:.1f} GB usable "
                  f"each): {len(fits):,} of {len(candidates):,} layouts fit", highlight=False)
    shown = fits[:top] or [c for c in candidates if c.runs][:top]  # none fits: the closest that run
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title_justify="left",
                  title=None if fits else "none fits; the closest that run:")
    for col in ("#", "layout", "peak GB", "step s", "tokens/s", "tok/s/dev", "MFU"):
        table.add_column(col, justify="left" if col == "layout" else "right", overflow="fold",
                         no_wrap=col != "layout")
    for i, c in enumerate(shown, 1):
        table.add_row(str(i), c.layout.describe() if wide else c.layout.short(), f"{c.memory.total / GB:.1f}",
                      f"{c.time.total:.3f}", f"{c.tokens_per_sec:,.0f}", f"{c.tokens_per_sec_per_device:,.0f}",
                      f"{c.mfu:.1%}")
    if shown:
        console.print(table)
    console.print(rest_line(candidates, fits, len(shown) if fits else 0, usable, wide), highlight=False)
    if wide:
        for count, why in why_not(candidates):
            console.print(f"  {count:>7,} {why}", highlight=False)
    if candidates:
        print_best(candidates[0], console, wide=wide, base=base)


def rest_line(candidates, fits, shown: int, usable: float, wide: bool) -> str:
    """One line counting the layouts the table does not show."""
    memory = sum(c.runs and not c.fits for c in candidates)
    refused = sum(not c.runs for c in candidates)
    line = f"{len(fits) - shown:,} more fit; {memory:,} need over {usable:.1f} GB; {refused:,} refused by forja train"
    return line + (":" if wide else " (--wide says why)")


def why_not(candidates, most: int = 8) -> list[tuple[int, str]]:
    """The commonest reasons layouts do not run or fit, with their counts (memory as one)."""
    reasons: dict[str, int] = {}
    for c in candidates:
        if not c.fits:
            why = "need more memory than usable" if c.runs else c.why_not.split(";")[0]
            reasons[why] = reasons.get(why, 0) + 1
    return sorted(((n, why) for why, n in reasons.items()), reverse=True)[:most]


def print_best(best, console: Console, *, wide: bool, base) -> None:
    """The best layout as the command that runs it; its memory and time, term by term."""
    console.file.flush()
    if not best.runs:
        print(f"no layout of these runs in forja train: {best.why_not}", flush=True)
        return
    label = "best" if best.fits else "closest"
    if wide or base is None:  # one line, never wrapped, whatever the terminal's width: copied whole
        print(f"{label}: " + set_line(best.layout), flush=True)
    else:
        recipe, overrides, cfg = base
        print(f"{label}, as a command (add --nproc / --nnodes to launch it):", flush=True)
        print("\n".join("  " + line for line in train_lines(recipe, overrides, changed_items(best.layout, cfg), 98)),
              flush=True)
    mem = ", ".join(f"{k} {v / GB:.2f}" for k, v in best.memory.as_dict().items() if v)
    times = ", ".join(f"{k} {v:.3f}" for k, v in best.time.as_dict().items() if v)
    console.print(f"memory at its peak ({best.memory.phase}, GB): {mem}", highlight=False)
    console.print(f"step time (s): {times}", highlight=False)


# -- --check: a finished run against its prediction ---------------------------------------------

def device_kind(hardware: dict) -> str | None:
    """The hardware table's kind of a run's device (run.json's hardware), None if unknown."""
    from forja.plan.hardware import kind_of_device

    gpus = hardware.get("gpus") or []
    return kind_of_device(gpus[0]) if gpus else "cpu"


def measured(run_dir: Path) -> tuple[float, float]:
    """(peak memory in bytes, median tokens/s after the first logged interval) of a run."""
    logged = [r for r in read_records(run_dir / "metrics.jsonl") if "tokens_per_sec" in r]
    rates = [r["tokens_per_sec"] for r in logged]
    peaks = [r.get("mem_peak_gb", 0.0) for r in logged]
    if len(rates) < 2:
        raise ForjaError(f"{run_dir}/metrics.jsonl holds {len(rates)} logged steps; check needs at least 2 "
                         "(the first is warm-up)")
    return max(peaks) * GB, statistics.median(rates[1:])


def check_run(run_dir: Path, args: argparse.Namespace) -> int:
    from forja.config import load_config
    from forja.plan.job import job_from_config
    from forja.plan.layout import Layout
    from forja.plan.planner import evaluate

    for name in ("config.toml", "run.json", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise ForjaError(f"{run_dir} has no {name}: --check needs the directory of a run forja train made")
    launch = json.loads((run_dir / "run.json").read_text())["launches"][-1]
    kind = device_kind(launch.get("hardware", {}))
    if kind is None:
        from forja.plan.hardware import UNKNOWN_FIX

        raise ForjaError(f"the run's device {launch['hardware'].get('gpus')} is not in the hardware table "
                         f"(unknown peak); {UNKNOWN_FIX}")
    args.gpu = args.gpu or kind
    hw = hardware_for(args)
    cfg = load_config(str(run_dir / "config.toml"))
    world = int(launch.get("world_size", 1))
    job = job_from_config(cfg, gpu=hw.kind != "cpu")
    c = evaluate(job, Layout.from_config(cfg.parallel, cfg.train.micro_batch_size, world), hw)
    peak, rate = measured(run_dir)
    rows = [("peak memory per rank (GB)", c.memory.total / GB, peak / GB),
            ("tokens/s (whole job)", c.tokens_per_sec, rate)]
    if args.json:
        print(json.dumps({"layout": c.layout.overrides(), "hardware": hw.kind, "world_size": world,
                          "predicted": {"peak_memory_bytes": c.memory.total, "tokens_per_sec": c.tokens_per_sec},
                          "measured": {"peak_memory_bytes": peak, "tokens_per_sec": rate},
                          "ratios": {"memory": peak / c.memory.total, "tokens_per_sec": rate / c.tokens_per_sec}}))
        return 0
    table = Table(title=f"{run_dir}: {c.layout.describe()} on {world} x {hw.name}", title_justify="left")
    for col in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="left" if not col else "right")
    for name, pred, meas in rows:
        table.add_row(name, f"{pred:,.2f}", f"{meas:,.2f}", f"{meas / pred:.2f}")
    console = Console()
    console.print(table)
    if hw.kind == "cpu":
        console.print("On a CPU the run logs its process's peak RSS, which also holds the Python runtime and "
                      "libraries (about 0.5-1 GB) besides the tensors the prediction counts.", highlight=False)
    return 0
