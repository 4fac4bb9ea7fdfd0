"""The anomaly verdict is decided in one place: the guard recovery hands the engine tells it only
whether to refuse the step, and recovery acts on the verdict it kept (Recovery.guard, .step)."""

from __future__ import annotations

import math

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager
from forja.checkpoint.states import TrainerCounters
from forja.train.config import TrainConfig
from forja.train.resilience.recovery import Outcome, Recovery
from forja.train.step.engine import StepOutput

from .test_mismatch import _Sink


def _recovery(tmp_path) -> tuple[Recovery, _Sink]:
    """A run that skips non-finite steps."""
    sink = _Sink()
    recovery = Recovery(TrainConfig(on_nonfinite="skip"), checkpoints=CheckpointManager(CheckpointConfig(), tmp_path),
                        counters=TrainerCounters(), loader=None, sinks=sink, reload=lambda path: None,
                        beat=lambda phase, step: None, rolled_back=lambda: None, rank=0)
    return recovery, sink


def _out(loss: float, skipped: bool) -> StepOutput:
    return StepOutput(loss=loss, grad_norm=1.0, tokens=8, lr=1e-3, skipped=skipped)


def test_the_guard_refuses_a_nan_and_recovery_acts_on_its_own_verdict(tmp_path):
    recovery, sink = _recovery(tmp_path)
    guard = recovery.guard()
    assert guard(math.nan, 1.0) is True  # the engine learns a yes or no, never the anomaly
    assert recovery.step(3, _out(math.nan, skipped=True)) is Outcome.SKIPPED
    [(step, event)] = sink.records
    assert step == 3 and event["event"] == "nonfinite" and event["action"] == "skip"
    assert recovery.counters.skipped_steps == 1


def test_each_step_gets_a_fresh_verdict(tmp_path):
    recovery, sink = _recovery(tmp_path)
    assert recovery.guard()(math.inf, 1.0) is True  # judged, but the step never reached recovery.step
    recovery.guard()  # the next step: an fp16 overflow, which the engine does not ask the guard about
    assert recovery.step(4, _out(2.0, skipped=True)) is Outcome.SKIPPED
    assert sink.records == [] and recovery.counters.skipped_steps == 0  # no stale anomaly acted on
    assert recovery.guard()(2.0, 1.0) is False and recovery.step(5, _out(2.0, skipped=False)) is Outcome.GO_ON
