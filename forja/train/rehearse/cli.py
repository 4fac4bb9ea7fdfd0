"""`forja plan ... --rehearse` and `forja train RECIPE --rehearse --world N`.

`forja plan` is the planner's command (forja/plan/cli.py), which never imports training code;
the rehearsal runs training code, so its flag is added here and `forja` registers the plan
command through `add_plan_cli`. Both write one JSON file (default rehearsal.json) and
nothing else.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from forja.errors import ForjaError
from forja.files import write_atomic

DEFAULT_JSON = "rehearsal.json"
REHEARSE_HELP = ("run forja's build and one training step of the layout at full size and world size on fake devices "
                 "in this process (no GPU), and print its memory by category and its collectives beside the "
                 f"prediction; writes JSON (default {DEFAULT_JSON})")


def add_plan_cli(sub: argparse._SubParsersAction) -> None:
    from forja.plan.cli import add_cli

    p = add_cli(sub)
    p.add_argument("--rehearse", nargs="?", const=DEFAULT_JSON, default=None, metavar="JSON",
                   help=REHEARSE_HELP + "; the best layout, or the one --layout gives")
    p.set_defaults(func=functools.partial(_plan, plain=p.get_default("func")))


def _plan(args: argparse.Namespace, plain) -> int:
    if args.rehearse is None:
        return plain(args)
    from forja.plan.cli import planned, print_plan
    from forja.plan.layout import with_layout

    out = _json_path(args.rehearse)
    cfg, hw, job, candidates = planned(args)
    print_plan(candidates, hw, args.gpus, args.top, job, wide=args.wide, base=(args.config, args.overrides, cfg))
    best = candidates[0]
    if not best.runs:
        raise ForjaError(f"no layout of {args.gpus} ranks runs in forja train ({best.why_not}): nothing to rehearse")
    return _rehearse(with_layout(cfg, best.layout), args.gpus, hw, out)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """`forja train`'s --rehearse, --world and --gpu."""
    g = p.add_argument_group("rehearsal", "the recipe as it would launch, on fake devices in this process")
    g.add_argument("--rehearse", nargs="?", const=DEFAULT_JSON, default=None, metavar="JSON", help=REHEARSE_HELP)
    g.add_argument("--world", type=int, default=None, metavar="N", help="the world size to rehearse (ranks)")
    g.add_argument("--gpu", default="h100", metavar="KIND",
                   help="the device the memory is judged against (forja/plan/hardware.toml; default h100)")


def train_rehearsal(args: argparse.Namespace) -> int:
    """`forja train RECIPE --rehearse --world N`: the recipe's layout (parallel.auto's choice on
    --gpu), checked and rehearsed; writes nothing but the JSON."""
    from forja.config import load_config
    from forja.plan.hardware import get_hardware
    from forja.plan.job import job_from_config
    from forja.plan.layout import with_layout
    from forja.plan.planner import plan

    if args.world is None or args.world < 1:
        raise ForjaError("--rehearse needs --world N, the number of ranks to rehearse (e.g. --world 64)")
    out = _json_path(args.rehearse)
    cfg = load_config(args.config, args.overrides)
    hw = get_hardware(args.gpu)
    if cfg.parallel.auto:
        fitting = [c for c in plan(job_from_config(cfg, gpu=True), hw, args.world) if c.fits]
        if not fitting:
            raise ForjaError(f"parallel.auto finds no layout of {args.world} ranks that fits {hw.name}")
        cfg = with_layout(cfg, fitting[0].layout)
    return _rehearse(cfg, args.world, hw, out)


def _json_path(given: str) -> Path:
    out = Path(given)
    if out.suffix != ".json" or not out.parent.is_dir():
        raise ForjaError(f"--rehearse {given}: give a .json file in an existing folder")
    return out


def _rehearse(cfg, world: int, hw, out: Path) -> int:
    from forja.train.rehearse.rehearsal import print_rehearsal, rehearse

    r = rehearse(cfg, world, hw)
    print_rehearsal(r)
    write_atomic(out, json.dumps(r.as_json(), indent=1).encode())
    print(f"wrote {out}")
    return 0
