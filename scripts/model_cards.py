"""The verification cards: one table in docs/models.md of what the tests verify for every model
family, made from the tests' results (tests/cards.py records them with `pytest --cards PATH`).

    python scripts/model_cards.py --run            # run the card tests (-m cards), then write the table
    python scripts/model_cards.py --results F ...  # the table from results already recorded (make test's)
    python scripts/model_cards.py --results F --check   # only fail where a cell has no passing test

A cell is the figure its test measured (the largest where several tests fill it), "pass" where a
test asserts without a figure, "n/a" where the column does not apply (expert parallelism for a
family without experts). The script exits 1, naming them, when a cell has no test, or a test of it
failed: a family added without its tests cannot pass `make test`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forja.models import FAMILIES  # noqa: E402
from tests.cards import COLUMNS  # noqa: E402

HEADERS = {"hf_load": "HF load: fp32 diff", "float64": "fp64 diff", "hf_save": "HF save", "generate": "generate",
           "fsdp": "FSDP", "tp_sp": "TP + SP", "pp": "PP", "ep": "EP", "cp_all_to_all": "CP all-to-all",
           "cp_ring": "CP ring", "resume": "resume", "flops": "FLOPs ratio"}
START, END = "<!-- cards: made by scripts/model_cards.py -->", "<!-- cards: end -->"
DOC = ROOT / "docs" / "models.md"


def applies(family: str, column: str) -> bool:
    """Expert parallelism only where some flavor of the family has experts."""
    return column != "ep" or any(f.get("n_experts") for f in FAMILIES[family].flavors.values())


def read_results(paths: list[Path]) -> dict[tuple[str, str], list[dict]]:
    cells: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                cells.setdefault((r["family"], r["column"]), []).append(r)
    return cells


def problems(cells: dict[tuple[str, str], list[dict]]) -> list[str]:
    """One line per cell that has no test, or a failed one."""
    out = []
    for family in FAMILIES:
        for column in COLUMNS:
            records = cells.get((family, column), [])
            if not applies(family, column):
                continue
            if not records:
                out.append(f"{family} x {HEADERS[column]}: no test recorded this cell")
            for r in records:
                if r["outcome"] != "passed":
                    out.append(f"{family} x {HEADERS[column]}: {r['test']} {r['outcome']}")
    return out


def _figure(records: list[dict]) -> str:
    numbers = [r["value"] for r in records if isinstance(r["value"], (int, float)) and not isinstance(r["value"], bool)]
    texts = sorted({r["value"] for r in records if isinstance(r["value"], str)})
    if numbers:
        m = max(numbers)
        if isinstance(m, int):  # a count (generate: new tokens)
            return str(m)
        return f"{m:.4f}" if 0.5 < m < 2 else ("0" if m == 0 else f"{m:.1e}")
    return ", ".join(texts) or "pass"


def table(cells: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| family | " + " | ".join(HEADERS[c] for c in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for family in FAMILIES:
        row = [("n/a" if not applies(family, c) else _figure(cells.get((family, c), [])) if cells.get((family, c))
                else "**no test**") for c in COLUMNS]
        lines.append(f"| `{family}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no cards markers ({START} ... {END}); put them where the table goes")
    head, rest = doc.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def run_card_tests(out: Path) -> list[Path]:
    """The card tests, as make test runs them: the single-process ones two at a time, then
    the process groups alone. Returns the results files."""
    out.unlink(missing_ok=True)
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--cards={out}"]
    for extra in (["-m", "cards and not serial", "-n", "2", "--dist", "loadfile"], ["-m", "cards and serial"]):
        subprocess.run(py + extra, cwd=ROOT, check=False)
    return [out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, nargs="*", default=[], help="results files from pytest --cards")
    p.add_argument("--run", action="store_true", help="run the card tests first (about 12 minutes here)")
    p.add_argument("--check", action="store_true", help="only check every cell has a passing test")
    a = p.parse_args(argv)
    paths = run_card_tests(ROOT / ".cards.jsonl") if a.run else a.results
    if not paths:
        p.error("give --results FILE (from pytest --cards FILE) or --run")
    cells = read_results(paths)
    if not a.check:
        write_doc(table(cells))
        print(f"wrote the cards' table to {DOC.relative_to(ROOT)}")
    bad = problems(cells)
    for line in bad:
        print(f"model cards: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
