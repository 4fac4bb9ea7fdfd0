"""The `forja` command line.

Each subcommand lives next to the code it drives and registers itself through an
`add_cli(subparsers)` function; this file only wires them together, imports them
lazily (so `forja --help` is fast) and turns a `ForjaError` into one clear line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

import forja
from forja.errors import INTERRUPTED, ForjaError

# subcommand -> "module:function" that adds its parser. The function sets `func` on
# its parser; `func(args)` returns an exit code.
_COMMANDS = {
    "train": "forja.train.cli:add_cli",
    "tokenizer": "forja.data.corpus.cli:add_tokenizer_cli",
    "prepare": "forja.data.corpus.cli:add_prepare_cli",
    "generate": "forja.generate:add_cli",
    "report": "forja.report:add_cli",
    "sweep": "forja.sweep:add_cli",
    "plan": "forja.train.rehearse.cli:add_plan_cli",  # the planner's command, with --rehearse
    "export": "forja.checkpoint.export:add_cli",
    "eval": "forja.eval.cli:add_cli",
    "lm-eval": "forja.eval.cli:add_lm_eval_cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forja", description="Pre-train large language models.")
    parser.add_argument("--version", action="version", version=f"forja {forja.__version__}",
                        help="print forja's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, target in _COMMANDS.items():
        if only is not None and name != only:
            # Still list it in --help, without importing its module.
            sub.add_parser(name, help=f"(see `forja {name} --help`)")
            continue
        module_name, func_name = target.split(":")
        getattr(importlib.import_module(module_name), func_name)(sub)
    return parser


def _unrecognized(extra: list[str]) -> str:
    """argparse's message for arguments no option takes; when they are files, most likely an
    unquoted pattern (`--source dir/*.txt`) that the shell expanded before forja saw it."""
    files = [a for a in extra if not a.startswith("-") and os.path.exists(a)]
    if len(files) < 2:
        return f"unrecognized arguments: {' '.join(extra)}"
    shown = " ".join(files[:3]) + (f" ... ({len(files)} in all)" if len(files) > 3 else "")
    return (f"unrecognized arguments: {shown}: the shell expanded an unquoted pattern into file names; "
            "quote the pattern so that forja expands it, e.g. --source 'data/*.txt'")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, as forja's command raises it (`catch_ctrl_c`). A subclass, because CPython
    (3.11-3.13) remembers a KeyboardInterrupt of exactly that class that crossed a C
    extension's PyRun_* call, even when it is then caught, and ends a `python -m` process by
    SIGINT in place of its exit code: a Ctrl-C while torch was being imported ended the
    launcher with -2 after it had printed its line and returned 130."""


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted


def catch_ctrl_c() -> None:
    """Ctrl-C raises `Interrupted`, where it raised Python's KeyboardInterrupt (a parent that
    ignores SIGINT, or a handler someone set, is left alone)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupted)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    catch_ctrl_c()
    # Import only the module of the command asked for: importing torch for `--help` is slow.
    # `--version` needs none of them ("" matches no command); `forja --help` imports them all.
    only = argv[0] if argv and argv[0] in _COMMANDS else ("" if "--version" in argv else None)
    parser = build_parser(only)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(_unrecognized(extra))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ForjaError as exc:
        print(f"forja {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C before training's own handler is set, or a second one
        print(f"forja {args.command}: interrupted (Ctrl-C); what was written is kept whole (files are written "
              "to a temporary name first): run the same command again to go on", file=sys.stderr)
        return INTERRUPTED
