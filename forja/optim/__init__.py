"""Optimizers and learning-rate schedules."""

from forja.optim.optimizers import OptimizerGroup, build_optimizer, param_groups
from forja.optim.schedules import SchedulerGroup, build_scheduler, lr_multiplier

__all__ = ["OptimizerGroup", "SchedulerGroup", "build_optimizer", "build_scheduler", "lr_multiplier",
           "param_groups"]
