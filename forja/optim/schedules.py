"""Learning-rate schedules: linear warmup, then cosine, linear, WSD or constant.

Each schedule is a function of the step returning a multiplier of the peak lr; a
`LambdaLR` applies it, so the scheduler's state is just its step count and a run
resumed with a different `train.steps` continues on the stretched schedule.
WSD (warmup-stable-decay; Hu et al. 2024, MiniCPM) holds the peak and decays only
over the last `decay_fraction` of the steps, so a run can be extended before decaying.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from forja.errors import ForjaError
from forja.optim.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, total_steps: int,
                  decay_steps: tuple[int, int] | None = None) -> Callable[[int], float]:
    """step (0-based count of completed optimizer steps) -> multiplier of the peak lr. `decay_steps`:
    wsd's decay over steps [first, last] (a data stage's lr_phase), held at the floor after,
    instead of the last schedule.decay_fraction of the steps."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def decay(progress: float) -> float:  # progress 0 -> 1 over the decay phase
        progress = min(max(progress, 0.0), 1.0)
        if cfg.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1 - (1 - floor) * progress  # linear and wsd's decay

    last = total_steps - 1  # the last step trains at the floor, the first after warmup at the peak

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)  # never exactly 0: the first step must move
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "wsd":
            decay_start, decay_end = max(total_steps - max(1, round(cfg.decay_fraction * total_steps)), warmup), last
            if decay_steps is not None:
                decay_start, decay_end = max(decay_steps[0], warmup), decay_steps[1]
            if step < decay_start:
                return 1.0
            return decay((step - decay_start) / max(1, decay_end - decay_start))
        return decay((step - warmup) / max(1, last - warmup))

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int,
                    decay: tuple[int, int] | None = None) -> LambdaLR:
    """One multiplier per parameter group: a group named in `schedule.groups` (its "name"
    entry: muon and adamw under Muon) warms up and decays by its own keys."""
    names = [g.get("name", "") for g in optimizer.param_groups]
    unknown = sorted(set(cfg.groups) - set(names))
    if unknown:
        raise ForjaError(f"schedule.groups names {unknown[0]!r}, which is not a parameter group of this "
                         f"optimizer; its groups: {', '.join(n for n in names if n)}")
    return LambdaLR(optimizer, [lr_multiplier(cfg.for_group(name), total_steps, decay) for name in names])


def reapply(scheduler: LambdaLR) -> None:
    """Set the optimizer's learning rates from the schedule at the scheduler's current step.

    Needed after a resume: the optimizer's saved state carries the learning rate of the old
    schedule, which differs when `train.steps` changed between launches."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "step() before optimizer.step()": intended here
        scheduler.last_epoch -= 1
        scheduler.step()


class SchedulerGroup:
    """The same schedule on every optimizer of an `OptimizerGroup`; one state for all."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], cfg: ScheduleConfig, total_steps: int,
                 decay: tuple[int, int] | None = None):
        self.schedulers = [build_scheduler(opt, cfg, total_steps, decay) for opt in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def reapply(self) -> None:
        for s in self.schedulers:
            reapply(s)

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(dict(state))
