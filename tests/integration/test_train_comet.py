"""A real training run logged to Comet ML offline, read back with comet_ml's own code, and
resumed into the same Comet experiment."""

from __future__ import annotations

import pytest

from forja.cli import main
from forja.metrics.trackers import load_tracking
from tests.trackers import comet_archive

from .conftest import losses, train_args

pytest.importorskip("comet_ml")


def _losses(metrics, after=0):
    return [(step, value) for name, step, value in metrics if name == "train/loss" and step > after]


def test_comet_offline_archive_records_the_run_and_its_resume(tmp_path, train_data):
    run = tmp_path / "run"
    changes = {"train.steps": "4", "metrics.sinks": '["jsonl", "comet"]', "metrics.interval": "2",
               "checkpoint.interval": "4", "metrics.tags": '["baseline"]'}
    assert main(train_args(run, train_data, **changes)) == 0
    key = load_tracking(run)["comet_experiment_key"]
    [first] = list((run / "comet").glob("*.zip"))
    assert first.name == f"{key}.zip"
    meta, metrics, params, _ = comet_archive(first)
    assert meta["offline_id"] == key and meta["project_name"] == "kode-pretraining"
    assert meta["resume_strategy"] == "create" and meta["tags"] == ["baseline"]
    expected = losses(run)
    assert _losses(metrics) == [(s, pytest.approx(v)) for s, v in expected.items()] and sorted(expected) == [2, 4]
    assert params["model.flavor"] == "debug"

    # Resumed from the step-4 checkpoint: a second archive for the same experiment key,
    # which `comet upload` appends to the experiment the first one created.
    resume = {**changes, "train.steps": "6", "metrics.tags": '["baseline", "longer"]'}
    assert main(train_args(run, train_data, **resume)) == 0
    [second] = [p for p in (run / "comet").glob("*.zip") if p != first]
    meta, metrics, params, _ = comet_archive(second)
    assert meta["offline_id"] == key and meta["resume_strategy"] == "get"
    assert sorted(meta["tags"]) == ["baseline", "longer"]  # metrics.* may change on resume
    assert _losses(metrics) == [(6, pytest.approx(losses(run)[6]))]
    assert params["train.steps"] == "6"
