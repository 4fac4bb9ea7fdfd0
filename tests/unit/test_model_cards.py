"""scripts/model_cards.py: the cards' table from recorded results, and its refusal of a card
with a cell no test filled or a test that failed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from forja.models import FAMILIES
from tests.cards import COLUMNS

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("model_cards", ROOT / "scripts" / "model_cards.py")
cards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cards)


def _results(tmp_path: Path, *, skip: tuple[str, str] | None = None, fail: tuple[str, str] | None = None) -> Path:
    """A results file with a passing record for every cell that applies, but `skip`; `fail` failed."""
    path = tmp_path / "cards.jsonl"
    lines = []
    for family in FAMILIES:
        for column in COLUMNS:
            if (family, column) == skip or not cards.applies(family, column):
                continue
            outcome = "failed" if (family, column) == fail else "passed"
            lines.append(json.dumps({"test": f"t::{family}-{column}", "outcome": outcome, "family": family,
                                     "column": column, "value": 3e-7 if column == "hf_load" else None}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_complete_card_passes_and_tabulates(tmp_path):
    cells = cards.read_results([_results(tmp_path)])
    assert cards.problems(cells) == []
    text = cards.table(cells)
    assert len(text.splitlines()) == 2 + len(FAMILIES)
    assert "| `llama` | 3.0e-07 | pass |" in text and "**no test**" not in text
    assert "n/a" in text  # a dense family's expert parallelism


@pytest.mark.parametrize("kind", ["skip", "fail"])
def test_a_cell_without_a_passing_test_fails_the_check(tmp_path, kind, capsys):
    cell = ("gpt2", "cp_ring")
    path = _results(tmp_path, **{kind: cell})
    assert cards.main(["--results", str(path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "gpt2 x CP ring" in err and len(err.strip().splitlines()) == 1


def test_the_table_replaces_what_stands_between_the_markers(tmp_path, monkeypatch):
    doc = tmp_path / "models.md"
    doc.write_text(f"# Models\n\nabove\n\n{cards.START}\nold table\n{cards.END}\n\nbelow\n")
    monkeypatch.setattr(cards, "DOC", doc)
    cards.write_doc("| new |")
    assert doc.read_text() == f"# Models\n\nabove\n\n{cards.START}\n| new |\n{cards.END}\n\nbelow\n"
