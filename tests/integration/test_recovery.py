"""Drills of one process: a NaN or a spike injected at a step (`debug.inject`), and what
`train.on_nonfinite` / `train.spike` / `train.rollback` make of it."""

from __future__ import annotations

import json

import pytest

from forja.cli import main

from .conftest import losses, read_metrics, train_args

STEPS = "16"
# Checkpoints every 4 steps; a spike is judged against the last 8 accepted steps.
COMMON = {"train.steps": STEPS, "train.val_interval": "0", "train.sample_tokens": "0", "checkpoint.interval": "4",
          "train.spike": '{action = "rollback", window = 8, min_steps = 4, threshold = 6.0}'}


def _run(run, data, *drills: str, **changes) -> int:
    inject = json.dumps(list(drills))
    return main(train_args(run, data, **{**COMMON, "debug.inject": inject, **changes}))


def _events(run) -> list[dict]:
    return [r for r in read_metrics(run) if "event" in r]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, train_data):
    """The same run without any fault: the trajectory a transient fault must not change."""
    run = tmp_path_factory.mktemp("clean") / "run"
    assert _run(run, train_data) == 0
    assert not _events(run)  # no natural spike to confuse the drills with
    return run


def test_a_transient_nan_rolls_back_and_ends_bit_for_bit_as_the_clean_run(tmp_path, train_data, clean_run):
    clean = losses(clean_run)
    run = tmp_path / "run"
    assert _run(run, train_data, "nan@10", **{"train.on_nonfinite": '"rollback"'}) == 0
    events = _events(run)
    assert [(e["event"], e.get("action"), e["step"]) for e in events] == [("nonfinite", "rollback", 10),
                                                                         ("replay", None, 10)]
    assert events[0]["health/rollback_to"] == 8 and events[1]["verdict"] == "transient"
    assert events[1]["health/replay_max_diff"] == 0.0  # replayed step 9 came out as it first did
    assert losses(run) == clean  # every step, bit for bit
    train = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert train == list(range(1, 17))  # the replayed step 9 is not logged twice
    summary = read_metrics(run)[-1]
    assert summary["rollbacks"] == 1 and 0 < summary["goodput"] < 1


def test_a_spike_that_comes_back_on_replay_is_a_bad_batch_and_its_window_is_skipped(tmp_path, train_data, clean_run):
    clean = losses(clean_run)
    run = tmp_path / "run"
    assert _run(run, train_data, "spike@11:repeat", **{"train.rollback": "{skip_steps = 2}"}) == 0
    events = _events(run)
    assert [(e["event"], e["action"]) for e in events] == [("spike", "rollback"), ("spike", "skip")]
    assert events[0]["metric"] in ("loss", "grad_norm") and events[0]["health/sigmas"] > 6
    assert events[1]["verdict"] == "bad batch" and events[1]["health/skipped_batches"] == 2
    got = losses(run)
    assert all(got[s] == clean[s] for s in range(1, 11))  # before the bad batch: unchanged
    assert got[12] != clean[12]  # after it: trained on later data (the window was skipped)
    counters = json.loads((run / "checkpoints" / "step-00000016" / "forja.json").read_text())
    assert counters["step"] == 16


def test_skip_counts_the_step_and_leaves_the_weights_alone(tmp_path, train_data, clean_run):
    clean = losses(clean_run)
    run = tmp_path / "run"
    assert _run(run, train_data, "nan@6:rank=0", **{"train.on_nonfinite": '"skip"'}) == 0
    (event,) = _events(run)
    assert (event["event"], event["action"], event["step"], event["health/skipped_steps"]) == ("nonfinite", "skip",
                                                                                               6, 1)
    got = losses(run)
    assert got[5] == clean[5] and got[7] != clean[7]
    assert [r for r in read_metrics(run) if r.get("step") == 16 and "loss" in r][0]["skipped_steps"] == 1


def test_rollbacks_stop_at_the_limit_with_a_clear_message(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    changes = {"train.on_nonfinite": '"rollback"', "train.rollback": "{max = 1}"}
    assert _run(run, train_data, "nan@6", "nan@10", **changes) != 0
    assert "rolled back 1 times already (train.rollback.max = 1)" in capsys.readouterr().err
    assert [(e["event"], e.get("action"), e["step"]) for e in _events(run)] == [
        ("nonfinite", "rollback", 6), ("replay", None, 6), ("nonfinite", "stop", 10)]
    assert (run / "checkpoints" / "step-00000008").is_dir()  # intact, for the user to resume from


def test_a_spike_with_action_stop_stops(tmp_path, train_data, capsys):
    spike = '{action = "stop", window = 8, min_steps = 4}'
    assert _run(tmp_path / "run", train_data, "spike@9", **{"train.spike": spike}) != 0
    assert "standard deviations above its rolling mean" in capsys.readouterr().err


def test_after_a_rollback_the_learning_rate_is_lowered_for_a_few_steps(tmp_path, train_data, clean_run):
    run = tmp_path / "run"
    assert _run(run, train_data, "nan@10", **{"train.on_nonfinite": '"rollback"',
                                              "train.rollback": "{lr_scale = 0.5, lr_steps = 2}"}) == 0
    lr = {r["step"]: r["lr"] for r in read_metrics(run) if "loss" in r}
    clean_lr = {r["step"]: r["lr"] for r in read_metrics(clean_run) if "loss" in r}
    assert lr[9] == clean_lr[9] and lr[12] == clean_lr[12]
    assert lr[10] == pytest.approx(clean_lr[10] / 2) and lr[11] == pytest.approx(clean_lr[11] / 2)
    clean = losses(clean_run)
    assert losses(run)[10] == clean[10] and losses(run)[11] != clean[11]  # step 10's update is the first smaller one


def test_drills_are_refused_in_a_config_file_and_checked_before_any_write(tmp_path, train_data, capsys):
    recipe = tmp_path / "drill.toml"
    recipe.write_text('[debug]\ninject = ["kill@3"]\n')
    assert main(["train", str(recipe)]) != 0
    assert "drills come only from the command line" in capsys.readouterr().err
    assert _run(tmp_path / "run", train_data, "boom@3") != 0
    assert "debug.inject entry 'boom@3' is not a drill" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
