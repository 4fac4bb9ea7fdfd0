"""Dynamic loss scaling for float16 training (train.precision = "fp16").

float16 has 5 exponent bits: gradients below about 6e-8 flush to zero. The loss is
multiplied by a large `scale` before backward, so the gradients are `scale` times larger and
stay representable, and they are divided by it again (in place, on each rank's local shards)
before the global norm, clipping and the optimizer (Micikevicius et al. 2018, "Mixed
Precision Training", arXiv 1710.03740). When the scaled gradients overflow, their global
norm is inf or NaN while the loss itself is finite: the step is skipped and the scale
halved; after `growth_interval` clean steps in a row it is doubled. This is what
`torch.amp.GradScaler` does, written here because the step engine already knows the global
norm after every reduction (FSDP2's DTensor shards, TP, pipeline stages), which is
non-finite exactly when any rank overflowed, and already syncs with the host once a step to
decide on it: no second check, no extra collective.

The scale is a power of two, so scaling and unscaling are exact.

`LossScaling` is the scaler as the engine's step hook (forja/train/step/hooks.py): the engine
owns the scale (the trainer never reads it; a checkpoint reaches it through the engine's
`stateful()`), runs each step at it, asks the hook whether the step overflowed before the
guard is asked, and the hook moves the scale after the step and names its metrics:

    loss_scale   the scale the step ran with
    overflow     1.0 when the step overflowed and was skipped
    overflows    overflow steps in the run so far
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.stateful import Stateful

from forja import metric_names as names
from forja.train.config import TrainConfig
from forja.train.step.hooks import StepDone, StepHook, StepShare

# Below this the scale stops halving: a run that overflows at scale 1 has a real fault
# (the gradients themselves are inf), which the health policy, not the scaler, must see.
MIN_SCALE = 1.0


class LossScaler(Stateful):
    """The loss scale and its growth tracker. Checkpointed, so a resumed run goes on with
    the scale it had found instead of overflowing its way down from the initial one again."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.clean_steps = 0
        """Steps without overflow since the scale last changed."""
        self.overflows = 0
        """Overflow steps (skipped) in the run so far."""

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide `grads` (plain local tensors: a DTensor's local shard) by the scale, in place."""
        unscale_(grads, self.scale)

    def can_back_off(self) -> bool:
        """Whether an inf/NaN gradient norm with a finite loss is an overflow the scale can cure."""
        return self.scale > MIN_SCALE

    def update(self, overflow: bool) -> None:
        """After a step: halve on overflow, double after growth_interval clean steps."""
        if overflow:
            self.scale = max(self.scale / 2, MIN_SCALE)
            self.clean_steps = 0
            self.overflows += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])


class LossScaling(StepHook):
    """fp16's dynamic loss scale as a step hook."""

    def __init__(self, scaler: LossScaler):
        self.scaler = scaler
        self._scale, self._overflow = scaler.scale, False

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def begin(self, share: StepShare) -> None:
        self._scale, self._overflow = share.loss_scale, False

    def refuses(self, loss: float, grad_norm: float) -> bool:
        """A finite loss whose scaled gradients overflowed on some rank: the global norm is
        inf/NaN. At the scale's floor it is a real fault instead, the guard's to judge."""
        self._overflow = math.isfinite(loss) and not math.isfinite(grad_norm) and self.scaler.can_back_off()
        return self._overflow

    def end(self, done: StepDone) -> dict[str, float]:
        """The step's scale and overflow, then the scale's update. A step the guard refused
        (a NaN loss, a spike) says nothing about the scale: it is left as it is."""
        if self._overflow or done.stepped:
            self.scaler.update(self._overflow)
        return {names.LOSS_SCALE: self._scale, names.OVERFLOW: float(self._overflow),
                names.OVERFLOWS: float(self.scaler.overflows)}

    def stateful(self) -> dict:
        return {"scaler": self.scaler}  # the loss scale the run has found


@torch.no_grad()
def unscale_(grads: list[torch.Tensor], scale: float) -> None:
    """Divide `grads` (plain local tensors: a DTensor's local shard) by `scale`, in place."""
    if grads:
        torch._foreach_mul_(grads, 1.0 / scale)


def loss_scaler(cfg: TrainConfig) -> LossScaler | None:
    """The run's loss scaler: one under train.precision = "fp16", None otherwise."""
    if cfg.precision != "fp16":
        return None
    return LossScaler(cfg.fp16_init_scale, cfg.fp16_growth_interval)
