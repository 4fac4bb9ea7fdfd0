"""Optimizers and learning-rate schedules."""

from forja.optim.optimizers import build_optimizer, param_groups
from forja.optim.schedules import build_scheduler, lr_multiplier

__all__ = ["build_optimizer", "build_scheduler", "lr_multiplier", "param_groups"]
