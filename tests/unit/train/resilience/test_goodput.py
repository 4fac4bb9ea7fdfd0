"""Goodput's ledger of launches (forja/train/resilience/goodput.py) and the straggler rule."""

from __future__ import annotations

import json

import pytest

from forja.train.resilience.goodput import Goodput
from forja.train.resilience.stragglers import stragglers


def _ledger(tmp_path, segments):
    (tmp_path / "goodput.json").write_text(json.dumps({"segments": segments}))
    return Goodput(tmp_path, rank=0)


def test_the_gap_after_a_crash_counts_and_after_a_clean_end_does_not(tmp_path, monkeypatch):
    seg = {"checkpoint_s": 1.0, "rollbacks": 0}
    ledger = _ledger(tmp_path, [{"start": 0.0, "last": 100.0, "clean": False, **seg},   # died at ~100
                                {"start": 130.0, "last": 200.0, "clean": True, **seg},  # restarted 30 s later
                                {"start": 10_000.0, "last": 10_050.0, "clean": False, **seg, "rollbacks": 2}])
    monkeypatch.setattr("forja.train.resilience.goodput.time.time", lambda: 10_050.0)
    assert ledger.wall_s() == pytest.approx(100 + 30 + 70 + 50)
    summary = ledger.summary(productive_s=125.0)
    assert summary["goodput"] == pytest.approx(0.5) and summary["restarts"] == 1
    assert summary["rollbacks"] == 2 and summary["checkpoint_stall_s"] == 3.0


def test_a_new_launch_is_recorded_and_ends_clean(tmp_path):
    ledger = Goodput(tmp_path, rank=0)
    ledger.start()
    ledger.beat(checkpoint_s=0.5, rollback=True)
    ledger.end()
    (seg,) = json.loads((tmp_path / "goodput.json").read_text())["segments"]
    assert seg["clean"] and seg["checkpoint_s"] == 0.5 and seg["rollbacks"] == 1
    other = tmp_path / "other"
    other.mkdir()
    follower = Goodput(other, rank=1)
    follower.start()
    assert not follower.path.exists()  # rank 0 keeps the ledger


def test_stragglers_are_named_against_the_median():
    assert stragglers([0.1, 0.1, 0.1, 0.4], factor=1.5) == [3]
    assert stragglers([0.05, 0.25], factor=1.5) == [1]  # two ranks: the lower middle
    assert stragglers([0.1, 0.12, 0.11], factor=1.5) == []
