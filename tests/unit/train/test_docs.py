"""docs/training.md documents every config key (so adding a key means documenting it)."""

import dataclasses
import typing
from pathlib import Path

from forja.config import Config

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"


def test_every_config_key_is_documented():
    text = DOC.read_text()
    hints = typing.get_type_hints(Config)
    missing = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
               for f in dataclasses.fields(hints[s.name]) if f"`{s.name}.{f.name}`" not in text]
    assert missing == []
