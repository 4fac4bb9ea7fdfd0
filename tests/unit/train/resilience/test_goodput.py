"""Goodput's ledger of launches (forja/train/resilience/goodput.py) and the straggler rule."""

from __future__ import annotations

import json

import pytest

from forja.train.resilience.goodput import Goodput, goodput_line
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


def test_start_up_is_recorded_apart_and_a_short_run_is_told_why_it_reads_low(tmp_path, monkeypatch):
    """Each launch's start-up (to its first step) is summed apart; the end-of-run line says what
    goodput counts and splits the rest of the wall time; a run whose start-up weighs a fifth or
    more of it is told this is expected, a long one is not."""
    clock = iter([100.0, 103.0, 110.0, 200.0, 201.0, 205.0, 205.0])  # each call of time.time() in turn
    monkeypatch.setattr("forja.train.resilience.goodput.time.time", lambda: next(clock))
    ledger = Goodput(tmp_path, rank=0)
    ledger.start()  # at 100, start-up to 103, ended clean at 110
    ledger.ready()
    ledger.end()
    ledger.start()  # a second launch at 200: start-up 1 s, ends at 205
    ledger.ready()
    ledger.end()
    summary = ledger.summary(productive_s=9.0)
    assert summary["startup_s"] == pytest.approx(4.0) and summary["wall_s"] == pytest.approx(15.0)
    line = goodput_line(summary)
    assert line.startswith("forja: goodput 60.0% (9.0 s of 15.0 s in steps that count; start-up 4.0 s, "
                           "checkpoint stalls 0.0 s, other 2.0 s; 0 restarts, 0 rollbacks)")
    assert "as expected" in line  # 4 s of 15: a short run
    long_run = {**summary, "wall_s": 1000.0, "productive_s": 990.0, "goodput": 0.99}
    assert "\n" not in goodput_line(long_run) and "other 6.0 s" in goodput_line(long_run)


def test_stragglers_are_named_against_the_median():
    assert stragglers([0.1, 0.1, 0.1, 0.4], factor=1.5) == [3]
    assert stragglers([0.05, 0.25], factor=1.5) == [1]  # two ranks: the lower middle
    assert stragglers([0.1, 0.12, 0.11], factor=1.5) == []
