"""Every tracker of a real training run, read back with its own library."""

from __future__ import annotations

import pytest

from forja.cli import main
from forja.metrics.trackers import load_tracking
from tests.trackers import read_tensorboard, run_record, wandb_history

from .conftest import losses, train_args


def test_all_sinks_record_the_run(tmp_path, train_data, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    run = tmp_path / "run"
    sinks = '["console", "jsonl", "tensorboard", "wandb", "mlflow"]'
    # A NaN at step 5, skipped: its event reaches every tracker as health/... numbers.
    # metrics.tags from the command line reach every tracker, each read back below.
    assert main(train_args(run, train_data, **{"train.steps": "6", "metrics.sinks": sinks,
                                               "metrics.tags": '["baseline", "data/tiny"]',
                                               "metrics.interval": "2", "train.val_interval": "3",
                                               "debug.inject": '["nan@5"]', "train.on_nonfinite": '"skip"'})) == 0
    expected = losses(run)
    assert sorted(expected) == [2, 4, 6]

    tb = read_tensorboard(run / "tensorboard")
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(s, pytest.approx(v)) for s, v in
                                                                      expected.items()]
    assert [e.step for e in tb.Scalars("val/loss")] == [3, 6]
    assert [(e.step, e.value) for e in tb.Scalars("health/skipped_steps")] == [(5, 1.0)]
    [tags] = tb.Tensors("tags/text_summary")
    assert (tags.step, tags.tensor_proto.string_val[0].decode()) == (1, "`baseline` `data/tiny`")

    run_id = load_tracking(run)["wandb_run_id"]
    [session] = list((run / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
    assert run_record(session).project == "kode-pretraining"
    assert list(run_record(session).tags) == ["baseline", "data/tiny"]
    history = [(r["step"], r["train/loss"]) for r in wandb_history(session) if "train/loss" in r]
    assert history == [(s, pytest.approx(v)) for s, v in expected.items()]
    assert [(r["step"], r["health/skipped_steps"]) for r in wandb_history(session)
            if "health/skipped_steps" in r] == [(5, 1)]

    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    mlflow_id = load_tracking(run)["mlflow_run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_id, "train/loss")] == \
        [(s, pytest.approx(v)) for s, v in expected.items()]
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_id, "health/skipped_steps")] == [(5, 1.0)]
    assert client.get_run(mlflow_id).data.params["model.flavor"] == "debug"

    # The data loader's accounts reach every tracker: the stage and the tokens each source gave.
    from .conftest import read_metrics

    given = {r["step"]: r["tokens/stdlib:json"] for r in read_metrics(run) if "tokens/stdlib:json" in r}
    assert sorted(given) == [2, 4, 6] and given[6] == 6 * 8 * 64
    assert [(e.step, e.value) for e in tb.Scalars("tokens/stdlib:json")] == sorted(given.items())
    stages = [(e.step, e.value) for e in tb.Scalars("train/stage")]  # step records and validation's (3, 6)
    assert sorted({s for s, _ in stages}) == [2, 3, 4, 6] and {v for _, v in stages} == {0}
    assert [(r["step"], r["tokens/stdlib:json"]) for r in wandb_history(session)
            if "tokens/stdlib:json" in r] == sorted(given.items())
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_id, "tokens/stdlib:json")] == \
        sorted(given.items())
    assert [m.step for m in client.get_metric_history(mlflow_id, "data/padding")] == [2, 4, 6]
    tags = client.get_run(mlflow_id).data.tags
    assert (tags["baseline"], tags["data/tiny"]) == ("", "")
