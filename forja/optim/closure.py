"""What every optimizer's `step(closure)` starts with: torch's contract that a closure
re-evaluates the model with gradients on (a step itself runs under no_grad) and that its
loss is what step returns."""

from __future__ import annotations

from collections.abc import Callable

import torch


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The loss of `closure` run with gradients enabled, or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
