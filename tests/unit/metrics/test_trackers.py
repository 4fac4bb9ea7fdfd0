"""TensorBoard, W&B (offline), MLflow and Comet (offline) sinks, each read back with its own library."""

import json

import pytest

from forja.metrics.sinks import MetricsConfig, build_sinks
from forja.metrics.trackers import CometSink, MLflowSink, TensorBoardSink, WandbSink, flatten, load_tracking
from tests.trackers import comet_archive, read_tensorboard, run_record, wandb_history

CONFIG = {"model": {"family": "llama", "dim": 64}, "optim": {"lr": 3e-4}, "tags": ["a", "b"]}


def test_flatten():
    assert flatten(CONFIG) == {"model.family": "llama", "model.dim": "64", "optim.lr": "0.0003",
                               "tags": '["a", "b"]'}


# -- TensorBoard ------------------------------------------------------------------------------

def test_tensorboard_scalars_and_resume(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.start(total_steps=40, start_step=0)
    for step in (10, 20, 30):
        sink.log(step, {"loss": 1.0 / step, "mfu": None})
    sink.log(20, {"val_loss": 0.5})
    sink.log_text(20, "sample", "hello\nworld")
    sink.close()

    resumed = TensorBoardSink(tmp_path / "tb")
    resumed.start(total_steps=40, start_step=20)  # step 30 came after the checkpoint: redone
    for step in (30, 40):
        resumed.log(step, {"loss": 2.0 / step})
    resumed.close()

    acc = read_tensorboard(tmp_path / "tb")
    assert "train/mfu" not in acc.Tags()["scalars"]
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(10, pytest.approx(0.1)), (20, pytest.approx(0.05)),
                    (30, pytest.approx(2 / 30)), (40, pytest.approx(0.05))]
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(20, 0.5)]
    [text] = acc.Tensors("samples/sample/text_summary")
    assert "hello\nworld" in text.tensor_proto.string_val[0].decode()


def test_tensorboard_dir_from_config(tmp_path):
    cfg = MetricsConfig(sinks=["tensorboard"], tensorboard_dir=str(tmp_path / "elsewhere"))
    [sink] = build_sinks(cfg, run_dir=tmp_path / "run", run_name="r", config={}, rank=0).sinks
    assert sink.log_dir == tmp_path / "elsewhere"
    [sink] = build_sinks(MetricsConfig(sinks=["tensorboard"]), run_dir=tmp_path / "run", run_name="r",
                         config={}, rank=0).sinks
    assert sink.log_dir == tmp_path / "run" / "tensorboard"


def log_then_resume(sink, resumed) -> None:
    """One session logging steps 10 (train, val, a sample), then a resumed one logging step 20."""
    sink.start(total_steps=30, start_step=0)
    sink.log(10, {"loss": 2.5, "mfu": None})
    sink.log(10, {"val_loss": 2.75})
    sink.log_text(10, "sample", "hello")
    sink.close()
    resumed.start(total_steps=30, start_step=10)
    resumed.log(20, {"loss": 2.0})
    resumed.close()


# -- W&B --------------------------------------------------------------------------------------

def test_wandb_offline_run_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    cfg = MetricsConfig(sinks=["wandb"])
    log_then_resume(WandbSink(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG),
                    WandbSink(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG))

    run_id = load_tracking(tmp_path)["wandb_run_id"]
    # W&B writes each session of an offline run to its own directory (`wandb sync` joins them).
    sessions = [(run_record(f), f) for f in (tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")]
    sessions.sort(key=lambda s: s[0].start_time.ToNanoseconds())
    assert len(sessions) == 2
    (run, _), files = sessions[0], [f for _, f in sessions]
    assert (run.run_id, run.project, run.display_name) == (run_id, "kode-pretraining", "tiny")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["model"] == {"family": "llama", "dim": 64}
    first, second = wandb_history(files[0]), wandb_history(files[1])
    assert [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in first[:2]] == [(10, 2.5, None),
                                                                                           (10, None, 2.75)]
    assert "train/mfu" not in first[0]
    assert first[2]["samples/sample/_type"] == "table-file"
    table = json.loads((files[0].parent / "files" / first[2]["samples/sample/path"]).read_text())
    assert table["columns"] == ["step", "text"] and table["data"] == [[10, "hello"]]
    assert [(r["step"], r["train/loss"]) for r in second] == [(20, 2.0)]


# -- MLflow -----------------------------------------------------------------------------------

def test_mlflow_local_store_params_metrics_and_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = MetricsConfig(sinks=["mlflow"])
    [sink] = build_sinks(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG, rank=0).sinks
    resumed = MLflowSink(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG)
    log_then_resume(sink, resumed)

    assert resumed.run_id == sink.run_id == load_tracking(tmp_path)["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "train/loss")] == [(10, 2.5), (20, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "val/loss")] == [(10, 2.75)]
    assert client.get_metric_history(sink.run_id, "train/mfu") == []
    run = client.get_run(sink.run_id)
    assert run.data.params["model.dim"] == "64" and run.info.run_name == "tiny"
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "kode-pretraining"
    sample = next((tmp_path / "mlartifacts").rglob("step_00000010.txt"))
    assert sample.read_text() == "hello"


# -- Comet ------------------------------------------------------------------------------------

def test_comet_offline_archives_and_resume_with_the_same_key(tmp_path, monkeypatch):
    import socket

    pytest.importorskip("comet_ml")
    # Offline means offline: any connection Comet tried would be recorded here (and refused).
    connections = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: connections.append(address))
    cfg = MetricsConfig(sinks=["comet"], comet_dir=str(tmp_path / "archives"), comet_project="tiny-project")
    [sink] = build_sinks(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG, rank=0).sinks
    log_then_resume(sink, CometSink(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG))

    key = load_tracking(tmp_path)["comet_experiment_key"]
    first = tmp_path / "archives" / f"{key}.zip"
    [second] = [p for p in (tmp_path / "archives").glob(f"{key}-*.zip")]
    meta, metrics, params, texts = comet_archive(first)
    assert meta["project_name"] == "tiny-project" and meta["resume_strategy"] == "create"
    assert [m for m in metrics if m[0].startswith(("train/", "val/"))] == [("train/loss", 10, 2.5),
                                                                         ("val/loss", 10, 2.75)]
    assert params["model.dim"] == "64" and params["tags"] == '["a", "b"]'
    assert texts == [(10, "samples/sample", "hello")]
    meta, metrics, _, _ = comet_archive(second)
    assert meta["offline_id"] == key and meta["resume_strategy"] == "get"
    assert [m for m in metrics if m[0] == "train/loss"] == [("train/loss", 20, 2.0)]
    assert connections == []
