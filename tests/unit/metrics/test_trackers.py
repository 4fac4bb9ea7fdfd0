"""TensorBoard, W&B (offline), MLflow and Comet (offline) sinks, each read back with its own library."""

import json

import pytest

from forja.errors import ForjaError
from forja.metrics.config import MetricsConfig
from forja.metrics.sinks import build_sinks
from forja.metrics.trackers import CometSink, MLflowSink, TensorBoardSink, WandbSink, flatten, load_tracking
from tests.trackers import comet_archive, finished_records, read_tensorboard, run_record, wandb_history

CONFIG = {"model": {"family": "llama", "dim": 64}, "optim": {"lr": 3e-4}, "tags": ["a", "b"]}
# metrics.tags of a first session and of its resume, which adds one.
TAGS = ["baseline", "ablation/lr 3e-4", "v2.1:wide"]
RESUMED_TAGS = TAGS + ["resumed"]


@pytest.mark.parametrize("tags, words", [
    ("baseline", ["metrics.tags", "list of strings"]),
    (["baseline", "baseline"], ["metrics.tags", "twice"]),
    ([""], ["metrics.tags", "1 to 64"]),
    (["x" * 65], ["metrics.tags", "65 characters", "1 to 64"]),
    (["lr=3e-4"], ["metrics.tags", "'lr=3e-4'", "letters, digits"]),
    ([" baseline"], ["metrics.tags", "letters, digits"]),
    (["ablation/"], ["metrics.tags", "one path"]),
    (["a//b"], ["metrics.tags", "one path"]),
    (["../up"], ["metrics.tags", "one path"]),
    (["mlflow.note.content"], ["metrics.tags", "'mlflow.'"]),
    (["forja.run_dir"], ["metrics.tags", "'forja.'"]),
    ([3], ["metrics.tags", "not a string"]),
])
def test_bad_tags_are_refused_naming_the_key(tags, words):
    with pytest.raises(ForjaError) as err:
        MetricsConfig(tags=tags)
    for word in words:
        assert word in str(err.value)


def test_tags_at_the_limits_are_kept():
    tags = ["x" * 64, "a", "team/nlp v2:run_1.b-c", "ünïcode"]
    assert MetricsConfig(tags=tuple(tags)).tags == tags
    assert MetricsConfig().tags == []


def test_flatten():
    assert flatten(CONFIG) == {"model.family": "llama", "model.dim": "64", "optim.lr": "0.0003",
                               "tags": '["a", "b"]'}


# -- TensorBoard ------------------------------------------------------------------------------

def test_tensorboard_scalars_and_resume(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb", TAGS)
    sink.start(total_steps=40, start_step=0)
    for step in (10, 20, 30):
        sink.log(step, {"loss": 1.0 / step, "mfu": None})
    sink.log(20, {"val_loss": 0.5})
    sink.log_text(20, "sample", "hello\nworld")
    sink.close()

    for _ in range(2):  # resumed twice from the same checkpoint: the tags are written once
        resumed = TensorBoardSink(tmp_path / "tb", RESUMED_TAGS)
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
    # TensorBoard has no run tags: each session writes them as text at its first step. Read as
    # TensorBoard's server reads text (its plugin accumulator, which purges text on resume too).
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    served = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    served.Reload()
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in served.Tensors("tags/text_summary")] == [
        (1, "`baseline` `ablation/lr 3e-4` `v2.1:wide`"), (21, "`baseline` `ablation/lr 3e-4` `v2.1:wide` `resumed`")]


def test_tensorboard_dir_from_config(tmp_path):
    cfg = MetricsConfig(sinks=["tensorboard"], tensorboard_dir=str(tmp_path / "elsewhere"), tags=TAGS)
    [sink] = build_sinks(cfg, run_dir=tmp_path / "run", run_name="r", config={}, rank=0).sinks
    assert sink.log_dir == tmp_path / "elsewhere" and sink.tags == TAGS
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
    cfg = MetricsConfig(sinks=["wandb"], tags=TAGS)
    resumed_cfg = MetricsConfig(sinks=["wandb"], tags=RESUMED_TAGS)
    log_then_resume(WandbSink(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG),
                    WandbSink(resumed_cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG))

    run_id = load_tracking(tmp_path)["wandb_run_id"]
    # W&B writes each session of an offline run to its own directory (`wandb sync` joins them).
    sessions = [(run_record(f), f) for f in (tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")]
    sessions.sort(key=lambda s: s[0].start_time.ToNanoseconds())
    assert len(sessions) == 2
    (run, _), files = sessions[0], [f for _, f in sessions]
    assert (run.run_id, run.project, run.display_name) == (run_id, "kode-pretraining", "tiny")
    # Each session's run record carries its config's tags (a resume's replace the run's at `wandb sync`).
    assert [list(r.tags) for r, _ in sessions] == [TAGS, RESUMED_TAGS]
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
    # Each group forja logs under is charted against its step, not W&B's own counter.
    globs = {r.metric.glob_name: r.metric.step_metric for r in finished_records(files[0])
             if r.WhichOneof("record_type") == "metric" and r.metric.glob_name}
    assert globs == dict.fromkeys(["train/*", "val/*", "eval/*", "moe/*", "attn/*", "health/*", "samples/*",
                                  "data/*", "tokens/*"], "step")


# -- MLflow -----------------------------------------------------------------------------------

def test_mlflow_local_store_params_metrics_and_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = MetricsConfig(sinks=["mlflow"], tags=TAGS)
    [sink] = build_sinks(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG, rank=0).sinks
    resumed = MLflowSink(MetricsConfig(sinks=["mlflow"], tags=RESUMED_TAGS), run_dir=tmp_path, run_name="tiny",
                         config=CONFIG)
    log_then_resume(sink, resumed)

    assert resumed.run_id == sink.run_id == load_tracking(tmp_path)["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "train/loss")] == [(10, 2.5), (20, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "val/loss")] == [(10, 2.75)]
    assert client.get_metric_history(sink.run_id, "train/mfu") == []
    run = client.get_run(sink.run_id)
    assert run.data.params["model.dim"] == "64" and run.info.run_name == "tiny"
    assert run.info.status == "FINISHED"
    # Each tag a key with an empty value; the resume's tags set again (and its new one added).
    assert {k: v for k, v in run.data.tags.items() if not k.startswith(("mlflow.", "forja."))} == \
        dict.fromkeys(RESUMED_TAGS, "")
    assert run.data.tags["forja.run_dir"] == str(tmp_path.resolve())
    [found] = client.search_runs([run.info.experiment_id], filter_string="tags.`ablation/lr 3e-4` = ''")
    assert found.info.run_id == sink.run_id
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
    cfg = MetricsConfig(sinks=["comet"], comet_dir=str(tmp_path / "archives"), comet_project="tiny-project",
                        tags=TAGS)
    [sink] = build_sinks(cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG, rank=0).sinks
    resumed_cfg = MetricsConfig(sinks=["comet"], comet_dir=str(tmp_path / "archives"), comet_project="tiny-project",
                                tags=RESUMED_TAGS)
    log_then_resume(sink, CometSink(resumed_cfg, run_dir=tmp_path, run_name="tiny", config=CONFIG))

    key = load_tracking(tmp_path)["comet_experiment_key"]
    first = tmp_path / "archives" / f"{key}.zip"
    [second] = [p for p in (tmp_path / "archives").glob(f"{key}-*.zip")]
    meta, metrics, params, texts = comet_archive(first)
    assert meta["project_name"] == "tiny-project" and meta["resume_strategy"] == "create"
    assert sorted(meta["tags"]) == sorted(TAGS)  # the upload adds them to the experiment
    assert [m for m in metrics if m[0].startswith(("train/", "val/"))] == [("train/loss", 10, 2.5),
                                                                         ("val/loss", 10, 2.75)]
    assert params["model.dim"] == "64" and params["tags"] == '["a", "b"]'
    assert texts == [(10, "samples/sample", "hello")]
    meta, metrics, _, _ = comet_archive(second)
    assert meta["offline_id"] == key and meta["resume_strategy"] == "get"
    assert sorted(meta["tags"]) == sorted(RESUMED_TAGS)
    assert [m for m in metrics if m[0] == "train/loss"] == [("train/loss", 20, 2.0)]
    assert connections == []
