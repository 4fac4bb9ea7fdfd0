"""Learning-rate schedules: linear warmup, then cosine, linear, WSD or constant.

Each schedule is a function of the step returning a multiplier of the peak lr; a
`LambdaLR` applies it, so the scheduler's state is just its step count and a run
resumed with a different `train.steps` continues on the stretched schedule.
WSD (warmup-stable-decay; Hu et al. 2024, MiniCPM) holds the peak and decays only
over the last `decay_fraction` of the steps, so a run can be extended before decaying.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from forja.optim.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """step (0-based count of completed optimizer steps) -> multiplier of the peak lr."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def decay(progress: float) -> float:  # progress 0 -> 1 over the decay phase
        progress = min(max(progress, 0.0), 1.0)
        if cfg.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1 - (1 - floor) * progress  # linear and wsd's decay

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)  # never exactly 0: the first step must move
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "wsd":
            decay_start = total_steps - max(1, round(cfg.decay_fraction * total_steps))
            decay_start = max(decay_start, warmup)
            if step < decay_start:
                return 1.0
            return decay((step - decay_start + 1) / max(1, total_steps - decay_start))
        return decay((step - warmup + 1) / max(1, total_steps - warmup))

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(cfg, total_steps))
