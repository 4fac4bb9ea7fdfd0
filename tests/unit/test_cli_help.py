"""Every flag of every `forja` subcommand says what it does, and `forja --version` answers.

The parser is the one `forja` builds with every subcommand's module imported (build_parser()
with no `only`), walked to the bottom: an argument with empty help, or a subcommand with
neither help nor a description, fails and is named.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import forja
from forja.cli import build_parser


def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """Every undocumented thing under `parser`, as 'forja sub --flag'."""
    missing = []
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for sub_name, sub in action.choices.items():
                if not (helps.get(sub_name) or "").strip() or not (sub.description or "").strip():
                    missing.append(f"{path} {sub_name} (needs help= and description=)")
                missing += walk(sub, f"{path} {sub_name}")
        elif not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(f"{path} {name}")
    return missing


def test_every_subcommand_and_flag_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(subs.choices) >= 10  # every subcommand was imported, not stubbed
    assert walk(parser, "forja") == []


def test_the_walk_finds_what_has_no_help():
    parser = argparse.ArgumentParser(prog="x")
    subs = parser.add_subparsers()
    subs.add_parser("train", help="train", description="Train.").add_argument("--steps")
    subs.add_parser("export", help="export")  # no description
    assert walk(parser, "x") == ["x train --steps", "x export (needs help= and description=)"]


def test_version():
    out = subprocess.run([sys.executable, "-m", "forja", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"forja {forja.__version__}"
