"""`torch.compiler.disable`, made when first needed.

Decorating a function with `torch.compiler.disable` imports torch._dynamo (about 0.7 s of a
process's start on this CPU), which an eager run never uses: every forja process, and every
rank a test starts, paid it at import. `eager_only` marks the function the same way but makes
the disabled version only once compiling is possible: at its first call in a process that has
imported torch._dynamo, or before forja compiles anything (`before_compile`). In a process that
never imported torch._dynamo nothing is being compiled, and the function is called as it is.

Any layer may import this module (like forja.errors).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

_marked: list[Callable[[], None]] = []  # each marked function's way to make its disabled version


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, never traced into a compiled graph (a graph break around its call)."""
    made: dict[str, Callable[..., Any]] = {}

    def make() -> None:
        if "fn" not in made:
            made["fn"] = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        disabled = made.get("fn")
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # nothing can be compiling
                return fn(*args, **kwargs)
            make()
            disabled = made["fn"]
        return disabled(*args, **kwargs)

    _marked.append(make)
    return call


def before_compile() -> None:
    """Make every marked function's disabled version (call before torch.compile)."""
    for make in list(_marked):
        make()
