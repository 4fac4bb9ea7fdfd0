"""`forja train`: train from a recipe, resuming the run directory's latest checkpoint."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (resumes the run directory's latest checkpoint)",
                       description="Train a model. Rerunning the same command resumes the run.")
    p.add_argument("config", nargs="?", default="default",
                   help="a recipe name (configs/NAME.toml), a .toml path, or a run's config.toml "
                        "(default: 'default', the tiny Llama on the embedded stdlib corpus)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--start-over", action="store_true",
                   help="delete what run.dir holds and begin afresh instead of refusing a different config")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch this many processes on this machine through torchrun")
    p.set_defaults(func=run)


def _torchrun(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "forja", "train", args.config]
    cmd += [a for o in args.overrides for a in ("--set", o)]
    cmd += ["--start-over"] if args.start_over else []
    return subprocess.call(cmd)


def run(args: argparse.Namespace) -> int:
    from forja.config import load_config
    from forja.train.trainer import Trainer

    overrides = list(args.overrides) + (["run.start_over=true"] if args.start_over else [])
    cfg = load_config(args.config, overrides)  # errors surface before any process starts
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _torchrun(args)
    Trainer(cfg).run()
    return 0
