"""Is a step healthy? Non-finite values and spikes, and what the run does about them.

Every step's loss and gradient norm are checked before the optimizer steps (the engine
calls the guard `Recovery.guard` gave it, which asks `Health.check`, after its one host sync of
the step):

- a NaN or inf in either is a "nonfinite" anomaly, handled by `train.on_nonfinite`;
- with `train.spike.action` set, a value more than `threshold` standard deviations above
  the mean of the last `window` accepted steps is a "spike" (the rolling bound OLMo-core
  skips steps by). Only upward moves count: a loss falling fast is no fault.

An anomalous step never reaches the weights. Its action (forja/train/resilience/recovery.py takes it)
is then `skip` (count the step and go on), `stop`, or `rollback`: reload the last checkpoint
and replay from there. Replay is exact (data, RNG and reductions are deterministic), so the
steps up to the bad one come out bit for bit as before (checked, and reported), and the bad
step itself tells a bad batch (the anomaly comes back) from a transient fault (it does not).
A bad batch is skipped with `train.rollback.skip_steps` global batches; a transient fault
needs nothing. Rollbacks are counted in the process, not in checkpoints, so reloading one
never resets the count, and `train.rollback.max` ends a run that keeps spiking.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass

from torch.distributed.checkpoint.stateful import Stateful

from forja.train.config import SPIKE_METRICS, SpikeConfig, TrainConfig

# A window of near-identical values has a standard deviation near 0, which would make any
# wobble a "spike": the deviation is floored at this share of the mean.
MIN_RELATIVE_STD = 1e-3


@dataclass
class Anomaly:
    """What was wrong with a step."""

    kind: str
    """"nonfinite", "spike", "mismatch" (replicas' weights differ: forja/train/resilience/fingerprint.py)
    or "rerun" (a sampled step's rerun differed: forja/train/step/rerun.py)."""
    metric: str
    """"loss" or "grad_norm" ("weights" for a mismatch)."""
    value: float
    mean: float | None = None
    """Rolling mean and standard deviation it was judged against (spikes only)."""
    std: float | None = None
    text: str = ""
    """A mismatch or a rerun: which ranks differ."""

    @property
    def sigmas(self) -> float | None:
        return None if self.std is None else (self.value - self.mean) / self.std

    def describe(self) -> str:
        if self.kind in ("mismatch", "rerun"):
            return self.text
        if self.kind == "nonfinite":
            return f"the {self.metric} is {self.value}"
        return (f"the {self.metric} {self.value:.4g} is {self.sigmas:.1f} standard deviations above its "
                f"rolling mean {self.mean:.4g}")

    def fields(self) -> dict:
        """The anomaly as metrics: numbers for every tracker, names for metrics.jsonl."""
        out = {"event": self.kind, "metric": self.metric, "health/value": self.value}
        if self.std is not None:
            out |= {"health/mean": self.mean, "health/std": self.std, "health/sigmas": self.sigmas}
        return out


class SpikeDetector(Stateful):
    """Rolling windows of accepted steps' losses and gradient norms. Checkpointed, so a
    resumed or rolled-back run judges its next step against the same history."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.values = {m: deque(maxlen=cfg.window) for m in SPIKE_METRICS}

    def check(self, loss: float, grad_norm: float) -> Anomaly | None:
        values = {"loss": loss, "grad_norm": grad_norm}
        for metric, value in values.items():
            if not math.isfinite(value):
                return Anomaly("nonfinite", metric, value)
        if self.cfg.action == "off":
            return None
        for metric in self.cfg.metrics:
            history = self.values[metric]
            if len(history) < self.cfg.min_steps:
                continue
            mean = sum(history) / len(history)
            var = sum((v - mean) ** 2 for v in history) / (len(history) - 1)
            std = max(math.sqrt(var), MIN_RELATIVE_STD * abs(mean), 1e-12)
            if values[metric] > mean + self.cfg.threshold * std:
                return Anomaly("spike", metric, values[metric], mean, std)
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        self.values["loss"].append(loss)
        self.values["grad_norm"].append(grad_norm)

    def state_dict(self) -> dict:
        # A string: DCP stores it whole, whatever the window's length (a tensor would need
        # the same shape on load).
        return {"values": json.dumps({m: list(v) for m, v in self.values.items()})}

    def load_state_dict(self, state: dict) -> None:
        for metric, values in json.loads(state["values"]).items():
            self.values[metric] = deque(values, maxlen=self.cfg.window)


class Health:
    """The run's policy for anomalies, and the state of a rollback in progress."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.detector = SpikeDetector(cfg.spike)
        self.rollbacks = 0
        self.suspect: int | None = None
        """The step whose anomaly caused the last rollback, until it is replayed."""
        self.replay_until = 0
        """Steps up to this one are being replayed after a rollback."""
        self.first_run: dict[int, tuple[float, float]] = {}
        """(loss, grad_norm) of the steps since the last checkpoint, to compare replays with."""
        self.replay_diff = 0.0
        """Largest |difference| between a replayed step's values and the first run's."""
        self.can_roll_back = "rollback" in (cfg.on_nonfinite, cfg.spike.action)

    def check(self, loss: float, grad_norm: float) -> Anomaly | None:
        """What is wrong with a step's loss and gradient norm, or None (Recovery's guard asks it:
        an anomaly stops the optimizer step)."""
        return self.detector.check(loss, grad_norm)

    def action(self, anomaly: Anomaly) -> str:
        """skip, rollback or stop."""
        return self.cfg.on_nonfinite if anomaly.kind == "nonfinite" else self.cfg.spike.action

    def accepted(self, step: int, loss: float, grad_norm: float) -> None:
        """A step that went through: into the window, and compared with its first run."""
        self.detector.accept(loss, grad_norm)
        if step <= self.replay_until and step in self.first_run:
            first = self.first_run[step]
            self.replay_diff = max(self.replay_diff, abs(first[0] - loss), abs(first[1] - grad_norm))
        elif self.can_roll_back:  # kept until the next checkpoint, only when it may be replayed
            self.first_run[step] = (loss, grad_norm)

    def is_replay(self, step: int) -> bool:
        return step <= self.replay_until

    def checkpointed(self, step: int) -> None:
        """Steps up to a checkpoint are never replayed: forget them."""
        self.first_run = {s: v for s, v in self.first_run.items() if s > step}

    def rolled_back(self, bad_step: int) -> None:
        self.rollbacks += 1
        self.suspect = bad_step
        self.replay_until = bad_step - 1
        self.replay_diff = 0.0

    def verdict(self, step: int, anomalous: bool) -> str | None:
        """At the replay of the step that caused a rollback: "bad batch" when the anomaly came
        back, "transient" when it did not; None at any other step."""
        if step != self.suspect:
            return None
        self.suspect = None
        return "bad batch" if anomalous else "transient"

    def lr_scale(self, step: int) -> float:
        """The learning-rate factor of `step`: lowered for rollback.lr_steps steps from the
        step that caused the last rollback. The step engine multiplies the rates by it for the
        step (StepScales.lr); the schedule sets them afresh from its base at its next step
        (LambdaLR is not chained), so nothing lingers."""
        rb = self.cfg.rollback
        start = self.replay_until + 1
        if self.rollbacks and rb.lr_steps and start <= step < start + rb.lr_steps:
            return rb.lr_scale
        return 1.0
