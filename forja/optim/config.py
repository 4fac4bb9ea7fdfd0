"""The [optim] and [schedule] sections of a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forja.errors import ForjaError


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer."""

    name: str = "adamw"
    """Optimizer: adamw, adam or sgd (see forja/optim/optimizers.py)."""
    lr: float = 3e-4
    """Peak learning rate (reached after warmup)."""
    betas: tuple[float, ...] = (0.9, 0.95)
    """Adam's moment decay rates (beta1, beta2); sgd uses beta1 as momentum."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms or biases)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """Kernel: auto = fused on GPU, foreach elsewhere."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ForjaError(f"optim.lr = {self.lr} must be > 0")
        if len(self.betas) != 2:
            raise ForjaError(f"optim.betas = {list(self.betas)} must be two numbers, e.g. [0.9, 0.95]")


@dataclass(kw_only=True)
class ScheduleConfig:
    """The learning-rate schedule: linear warmup, then a decay."""

    name: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """After warmup: cosine or linear decay to min_lr_ratio, wsd (stable then decay), constant."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to optim.lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""
    decay_fraction: float = 0.2
    """wsd: the last fraction of the steps that decays (linearly) to min_lr_ratio."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ForjaError(f"schedule.warmup_steps = {self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ForjaError(f"schedule.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ForjaError(f"schedule.decay_fraction = {self.decay_fraction} must be in (0, 1]")
