"""docs/architecture.md's map of the package names every module, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import forja

ROOT = Path(forja.__file__).parent
DOC = ROOT.parent / "docs" / "architecture.md"


def mapped_paths(text: str) -> set[str]:
    """Paths under forja/ named in the map: each line's first column (before two spaces)
    holds names separated by ", "; a name ending in "/" opens a folder for the lines
    indented below it. "llama/, gpt2/" opens both."""
    block = text.split("## The layout", 1)[1].split("```", 2)[1]
    paths: set[str] = set()
    folders: list[tuple[int, list[str]]] = []  # (indent, folders opened at that indent)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = re.split(r", ", re.split(r"\s{2,}", line.strip())[0])
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parents = [""]
        for _, opened in folders:
            parents = [f"{p}{o}" for p in parents for o in opened]
        full = [f"{p}{n}" for p in parents for n in names]
        if all(n.endswith("/") for n in names):
            folders.append((indent, names))
        paths |= {f for f in full if f.endswith(".py")}
    return {p.removeprefix("forja/") for p in paths if p.startswith("forja/")}


def test_the_map_names_every_module_and_only_those():
    tree = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")}
    mapped = mapped_paths(DOC.read_text())
    assert sorted(tree - mapped) == []  # modules the map leaves out
    assert sorted(mapped - tree) == []  # modules the map names that do not exist


def test_the_parser_reads_nested_and_shared_folders():
    text = "## The layout\n```\nforja/\n  a.py, b.py  two\n  pkg/\n    x/, y/\n      m.py  one each\n  c.py\n```\n"
    assert mapped_paths(text) == {"a.py", "b.py", "pkg/x/m.py", "pkg/y/m.py", "c.py"}
