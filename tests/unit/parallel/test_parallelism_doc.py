"""docs/parallelism.md lists every [parallel] key (adding one means documenting it there too)."""

import dataclasses
from pathlib import Path

from forja.parallel.config import ParallelConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "parallelism.md"


def test_every_parallel_key_is_in_the_guide():
    text = DOC.read_text()
    assert [f.name for f in dataclasses.fields(ParallelConfig) if f"`parallel.{f.name}`" not in text] == []
