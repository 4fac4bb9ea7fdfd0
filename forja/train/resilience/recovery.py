"""Recovery: what the run does about a step the health check refused (forja/train/resilience/health.py).

The loop hands the engine this step's guard, then acts on the step:

    engine.train_step(batches, guard=recovery.guard())   whether the step may reach the weights
    outcome = recovery.step(step, out)    GO_ON, SKIPPED or ROLLED_BACK; raises to stop

The verdict on a step is decided here alone: the guard judges the loss and gradient norm
(`Health.check`), tells the engine only whether to refuse the step, and keeps what was wrong
with it for `step` to act on; the engine never carries it.

It owns the spike detector and the rollback bookkeeping (`Health`), the learning-rate factor
after a rollback (`lr_scale`, which the loop hands the engine) and replay's verdict, and it
reaches what acting needs (the checkpoint manager, the trainer's counters, the loader, the
metric sinks, the reload of a checkpoint) through what it was built with: the trainer does
not hold the policy.

    skip       count the step and go on (its weights were never touched)
    stop       a ForjaError naming the anomaly and what was kept
    rollback   back to the latest checkpoint (when there is one and train.rollback.max allows),
               the steps after it replayed exactly; at the replayed bad step, an anomaly again
               is a bad batch (skipped with train.rollback.skip_steps batches), none a
               transient fault (reported with how far the replay differed)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forja.checkpoint.manager import CheckpointManager
from forja.checkpoint.states import TrainerCounters
from forja.data.load.loader import DataLoader
from forja.errors import ForjaError
from forja.metrics.sinks import Sink
from forja.train.config import TrainConfig
from forja.train.resilience.health import Anomaly, Health
from forja.train.step.engine import StepOutput
from forja.train.step.rerun import RerunVerdict


class Outcome(enum.Enum):
    """What the loop does after a step."""

    GO_ON = "go on"
    """The optimizer stepped."""
    SKIPPED = "skipped"
    """The step counts, its weights were left as they were (a skip, an fp16 overflow)."""
    ROLLED_BACK = "rolled back"
    """The run is back at its latest checkpoint: the counters are the checkpoint's."""


class Recovery:
    """The run's anomaly policy in action. `reload(path)` loads a checkpoint into every
    stateful part of the run; `beat(phase, step)` tells the hang watchdog; `rolled_back()`
    tells goodput."""

    def __init__(self, cfg: TrainConfig, *, checkpoints: CheckpointManager, counters: TrainerCounters,
                 loader: DataLoader, sinks: Sink, reload: Callable[[Path], None],
                 beat: Callable[[str, int], None], rolled_back: Callable[[], None], rank: int):
        self.cfg = cfg
        self.health = Health(cfg)
        self.checkpoints, self.counters, self.loader, self.sinks = checkpoints, counters, loader, sinks
        self.reload, self.beat, self.on_rolled_back, self.rank = reload, beat, rolled_back, rank
        self._anomaly: Anomaly | None = None  # the guard's verdict on the step in progress

    @property
    def detector(self):
        """The spike detector's windows: checkpointed with the run."""
        return self.health.detector

    # -- what the loop asks -------------------------------------------------------------------
    def guard(self) -> Callable[[float, float], bool]:
        """The engine's guard for the step about to run: True (refuse the step) when its loss or
        gradient norm is an anomaly, which is kept here for `step`. A fresh verdict each step:
        nothing of a step the engine did not judge (an fp16 overflow) or did not finish is left."""
        self._anomaly = None
        return self._judge

    def _judge(self, loss: float, grad_norm: float) -> bool:
        self._anomaly = self.health.check(loss, grad_norm)
        return self._anomaly is not None

    def lr_scale(self, step: int) -> float:
        """The learning-rate factor of `step` (lowered for a while after a rollback)."""
        return self.health.lr_scale(step)

    def is_replay(self, step: int) -> bool:
        """Whether `step` is being replayed after a rollback (validated and saved the first time)."""
        return self.health.is_replay(step)

    def checkpointed(self, step: int) -> None:
        self.health.checkpointed(step)

    def step(self, step: int, out: StepOutput) -> Outcome:
        """Act on the engine's step `step` and the guard's verdict on it: record a good one (and
        replay's verdict at the replayed bad step), skip, roll back, or stop with a ForjaError.
        A sampled step's rerun that differed is recorded first (`rerun_differed`)."""
        anomaly, self._anomaly = self._anomaly, None
        if out.rerun is not None:  # a sampled step's runs differed: recorded, or the run stops
            self.rerun_differed(step, out.rerun)
        if anomaly is not None:
            return self._on_anomaly(step, anomaly)
        if out.skipped:
            return Outcome.SKIPPED
        self.health.accepted(step, out.loss, out.grad_norm)
        if self.health.verdict(step, anomalous=False):  # the replayed bad step went through: transient
            diff = self.health.replay_diff
            self.sinks.log(step, {"event": "replay", "verdict": "transient", "health/replay_max_diff": diff})
            self.sinks.log_text(step, "health", f"step {step} replayed cleanly: the fault was transient "
                                f"(replayed steps differ from the first run by at most {diff:g})")
        return Outcome.GO_ON

    def corrupted(self, step: int, text: str) -> Outcome:
        """Replicas' weights differ after `step` (silent data corruption, `text` names the ranks):
        back to the latest checkpoint, whose replicas agreed (each is checked before it is saved),
        when train.rollback.max allows; else stop."""
        anomaly = Anomaly("mismatch", "weights", 1.0, text=text)
        why = "train.rollback.max = 0" if self.cfg.rollback.max == 0 else self._why_not_roll_back()
        if why is None:
            self._roll_back(step, anomaly)
            return Outcome.ROLLED_BACK
        self._event(step, anomaly, "stop")
        raise ForjaError(f"step {step}: silent data corruption: {text}, and {why}: training stopped; {self._kept()}. "
                         "Check that rank's device (memory errors, a faulty unit), and keep train.rollback.max > 0 "
                         "so that the run goes back to its last checkpoint")

    def rerun_differed(self, step: int, verdict: RerunVerdict) -> None:
        """A sampled step's rerun differed from its first run (forja/train/step/rerun.py): a
        transient fault is recorded and the step goes on with the result a third run agreed with;
        a rank that never gives the same result twice stops the run (a rollback would meet it again)."""
        anomaly = Anomaly("rerun", "step", 1.0, text=verdict.text)
        self._event(step, anomaly, "go on" if verdict.reproducible else "stop")
        if not verdict.reproducible:
            raise ForjaError(f"step {step}: silent data corruption: {verdict.text}: training stopped; {self._kept()}. "
                             "Take that rank's device out of the job (memory errors, a faulty unit) and resume")

    # -- anomalies: skip, stop or roll back ----------------------------------------------------
    def _on_anomaly(self, step: int, anomaly: Anomaly) -> Outcome:
        if self.health.verdict(step, anomalous=True):  # it came back on replay: the batch is bad
            skip = self.cfg.rollback.skip_steps
            self._event(step, anomaly, "skip", verdict="bad batch", **{"health/skipped_batches": skip})
            self.loader.skip_steps(skip - 1)  # this step's batch is already passed over
            self.counters.skipped_steps += 1
            return Outcome.SKIPPED
        action = self.health.action(anomaly)
        if action == "skip":
            self.counters.skipped_steps += 1
            self._event(step, anomaly, "skip")
            return Outcome.SKIPPED
        if action == "rollback" and self._can_roll_back(step, anomaly):
            self._roll_back(step, anomaly)
            return Outcome.ROLLED_BACK
        self._event(step, anomaly, "stop")
        raise ForjaError(f"step {step}: {anomaly.describe()}: training stopped and {self._kept()}. Lower "
                         "optim.lr, raise schedule.warmup_steps, or set train.on_nonfinite / train.spike.action "
                         "to 'skip' or 'rollback'")

    def _why_not_roll_back(self) -> str | None:
        """Why the run cannot go back now, or None when it can."""
        limit = self.cfg.rollback.max
        self.checkpoints.wait()  # a save in flight is the one to go back to
        if self.checkpoints.latest() is None:
            return "no checkpoint was written yet"
        if self.health.rollbacks >= limit:
            return f"the run rolled back {self.health.rollbacks} times already (train.rollback.max = {limit})"
        return None

    def _can_roll_back(self, step: int, anomaly: Anomaly) -> bool:
        why = self._why_not_roll_back()
        if why is None:
            return True
        self._event(step, anomaly, "stop")
        raise ForjaError(f"step {step}: {anomaly.describe()}, and {why}: training stopped; {self._kept()}. "
                         f"Look at the data near step {step}, lower optim.lr, or raise train.rollback.max")

    def _roll_back(self, step: int, anomaly: Anomaly) -> None:
        """Back to the latest checkpoint; the steps after it are replayed exactly."""
        latest = self.checkpoints.latest()
        self.beat("rollback", step)
        self.health.rolled_back(step)
        self._event(step, anomaly, "rollback", **{"health/rollback_to": int(latest.name.split("-")[-1])})
        self.reload(latest)
        self.on_rolled_back()
        if self.rank == 0:
            print(f"forja: step {step}: {anomaly.describe()}; rolled back to {latest.name} "
                  f"(rollback {self.health.rollbacks} of at most {self.cfg.rollback.max}), replaying from "
                  f"step {self.counters.step + 1}", flush=True)

    def _event(self, step: int, anomaly: Anomaly, action: str, **extra: Any) -> None:
        """An anomaly and what was done, to metrics.jsonl (names and numbers) and the trackers."""
        fields = {**anomaly.fields(), "action": action, **extra, "health/rollbacks": self.health.rollbacks,
                  "health/skipped_steps": self.counters.skipped_steps}
        if anomaly.kind == "spike" or extra.get("verdict"):
            fields["health/replay_max_diff"] = self.health.replay_diff
        self.sinks.log(step, fields)
        text = f"step {step}: {anomaly.describe()}; action: {action}"
        self.sinks.log_text(step, "health", text + (f" ({extra['verdict']})" if "verdict" in extra else ""))

    def _kept(self) -> str:
        latest = self.checkpoints.latest()
        return f"the last checkpoint, {latest}, is intact" if latest else "no checkpoint was written yet"
