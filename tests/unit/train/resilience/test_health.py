"""Anomaly detection and the rollback bookkeeping (forja/train/resilience/health.py)."""

from __future__ import annotations

import math

import pytest

from forja.errors import ForjaError
from forja.train.config import RollbackConfig, SpikeConfig, TrainConfig
from forja.train.resilience.health import Health, SpikeDetector


def _filled(action="skip", n=20, **kw) -> SpikeDetector:
    detector = SpikeDetector(SpikeConfig(action=action, window=20, min_steps=10, **kw))
    for i in range(n):
        detector.accept(3.0 + 0.01 * (i % 5), 1.0 + 0.05 * (i % 3))  # loss std ~0.014, norm std ~0.04
    return detector


def test_non_finite_values_are_anomalies_even_with_spikes_off():
    detector = SpikeDetector(SpikeConfig())
    assert detector.check(float("nan"), 1.0).kind == "nonfinite"
    found = detector.check(2.0, float("inf"))
    assert (found.kind, found.metric, math.isinf(found.value)) == ("nonfinite", "grad_norm", True)
    assert detector.check(1e9, 1e9) is None  # off: no judgement of size


def test_a_value_far_above_the_rolling_mean_is_a_spike_and_a_fall_is_not():
    detector = _filled()
    assert detector.check(3.05, 1.1) is None
    spike = detector.check(3.3, 1.0)
    assert (spike.kind, spike.metric) == ("spike", "loss") and spike.sigmas > 6
    assert "standard deviations above its rolling mean" in spike.describe()
    assert detector.check(2.0, 1.0) is None  # falling fast is what training does
    assert detector.check(3.0, 5.0).metric == "grad_norm"
    only_loss = _filled(metrics=["loss"])
    assert only_loss.check(3.0, 5.0) is None


def test_nothing_is_judged_before_min_steps():
    assert _filled(n=9).check(100.0, 100.0) is None
    assert _filled(n=10).check(100.0, 100.0) is not None


def test_the_window_survives_a_checkpoint():
    detector = _filled()
    restored = SpikeDetector(detector.cfg)
    restored.load_state_dict(detector.state_dict())
    assert list(restored.values["loss"]) == list(detector.values["loss"])
    assert restored.check(3.3, 1.0) is not None


def test_replay_bookkeeping_and_the_verdict():
    health = Health(TrainConfig(on_nonfinite="rollback", rollback=RollbackConfig(lr_scale=0.5, lr_steps=2)))
    for step in (9, 10):
        health.accepted(step, 4.0 + step, 1.0)
    health.rolled_back(11)
    assert health.is_replay(10) and not health.is_replay(11)
    health.accepted(9, 13.0, 1.0)
    health.accepted(10, 14.0, 1.0)
    assert health.replay_diff == 0.0
    assert health.verdict(10, anomalous=False) is None
    assert health.verdict(11, anomalous=True) == "bad batch"
    assert health.verdict(11, anomalous=True) is None  # given once
    assert [health.lr_scale(s) for s in (10, 11, 12, 13)] == [1.0, 0.5, 0.5, 1.0]
    health.checkpointed(10)
    assert health.first_run == {}


def test_bad_settings_are_refused_with_the_key():
    with pytest.raises(ForjaError, match="train.spike.metrics"):
        SpikeConfig(metrics=["perplexity"])
    with pytest.raises(ForjaError, match="min_steps"):
        SpikeConfig(window=10, min_steps=20)
    with pytest.raises(ForjaError, match="lr_scale"):
        RollbackConfig(lr_scale=2.0)
