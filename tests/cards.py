"""The verification cards' evidence: a test that verifies one cell of a family's card (its HF
load, a parallel layout's loss parity, its resume...) says so through the `card` fixture,
`card(family, column, value)`, and its outcome then stands for that cell. With
`pytest --cards PATH` the controller (the xdist workers hand their reports to it) appends one
JSON line per cell a test spoke for: node id, outcome, family, column, value.
scripts/model_cards.py reads those lines into the table of docs/models.md, and fails where a
cell has no passing test. Tests that take the fixture carry the `cards` marker (`make cards`
runs only them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

COLUMNS = ("hf_load", "float64", "hf_save", "generate", "fsdp", "tp_sp", "pp", "ep", "cp_all_to_all", "cp_ring",
           "resume", "flops")
"""Every column a card has, in the order the table prints them (scripts/model_cards.py names them)."""


def pytest_addoption(parser) -> None:
    parser.addoption("--cards", default=None, metavar="PATH",
                     help="append the verification cards' evidence (JSON lines) to PATH")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "card" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cards)


@pytest.fixture
def card(record_property):
    """card(family, column, value=None): this test verifies `column` of `family`'s card; `value`
    is the figure it measured (a float, or a short text)."""
    def record(family: str, column: str, value: float | str | None = None) -> None:
        if column not in COLUMNS:
            raise ValueError(f"card column {column!r} is not one of {', '.join(COLUMNS)}")
        record_property("card", json.dumps([family, column, value]))

    return record


def pytest_runtest_logreport(report) -> None:
    path = _results_path(report)
    if path is None or report.when != "call" and not report.failed:
        return
    entries = [json.loads(v) for k, v in report.user_properties if k == "card"]
    if not entries:
        return
    with Path(path).open("a") as f:
        for family, column, value in entries:
            f.write(json.dumps({"test": report.nodeid, "outcome": report.outcome, "family": family,
                                "column": column, "value": value}) + "\n")


_CONFIG: list = []


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cards: verifies a cell of a model family's verification card")
    _CONFIG[:] = [config]


def _results_path(report) -> str | None:
    """Where the controller appends (None under an xdist worker, or without --cards)."""
    if not _CONFIG or hasattr(_CONFIG[0], "workerinput"):
        return None
    return _CONFIG[0].getoption("--cards")
