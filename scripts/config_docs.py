"""Print the config reference tables of docs/training.md from the dataclasses' docstrings.

    python scripts/config_docs.py [SECTION ...]     # all sections by default

tests/unit/train/test_docs.py fails when a key is missing from docs/training.md: paste the new table.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing

from forja.config import Config


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def table(section: str) -> str:
    cls = typing.get_type_hints(Config)[section]
    docs, defaults = field_docs(cls), cls()
    rows = [f"### [{section}]", "", "| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{section}.{f.name}` | `{getattr(defaults, f.name)!r}` | {docs.get(f.name, '')} |"
             for f in dataclasses.fields(cls)]
    return "\n".join(rows)


if __name__ == "__main__":
    names = sys.argv[1:] or [f.name for f in dataclasses.fields(Config)]
    print("\n\n".join(table(n) for n in names))
