"""Experiment trackers as sinks: TensorBoard, Weights & Biases, MLflow and Comet ML.

Each imports its library when it is chosen (building the sink fails early, naming the pip
extra, when the library is missing). Metric names are grouped as in `tracker_key`:
train/loss, train/tokens_per_sec, val/loss. W&B, MLflow and Comet runs are resumable: the run id
(Comet's experiment key) is kept in <run_dir>/tracking.json, so a resumed training run
continues the same tracker run. The run tags (metrics.tags) are set again by every session: W&B
replaces a resumed run's tags with the config's (wandb.init(tags=...); an empty list leaves them as they
are), MLflow and Comet add them to the run's (a tag dropped from the config stays on the run).
TensorBoard has no run tags: they are written as a text entry.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from forja import metric_names as names
from forja.errors import ForjaError
from forja.files import write_atomic
from forja.metrics.config import MetricsConfig, missing_package
from forja.metrics.sinks import Metrics, Sink, tracker_key

TRACKING_FILE = "tracking.json"


def _require(module: str, sink: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing_package(sink) from exc


def load_tracking(run_dir: Path) -> dict[str, str]:
    """The tracker run ids a run directory remembers ({} when none)."""
    path = Path(run_dir) / TRACKING_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ForjaError(f"{path} is not valid JSON ({exc}); delete it to start new tracker runs") from exc


def save_tracking(run_dir: Path, **ids: str) -> None:
    """Add `ids` to <run_dir>/tracking.json (written to a temporary file, then renamed)."""
    data = load_tracking(run_dir) | ids
    write_atomic(Path(run_dir) / TRACKING_FILE, json.dumps(data, indent=2) + "\n")


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"model": {"dim": 64}} -> {"model.dim": "64"}: the flat string params MLflow wants."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= flatten(value, name + ".")
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def _numbers(metrics: Metrics) -> dict[str, float | int]:
    """The numbers of a record, under their tracker names. Names (a health event's "event",
    "action") stay in metrics.jsonl; trackers get the event's sentence as text instead."""
    return {tracker_key(key): value for key, value in metrics.items() if isinstance(value, (int, float))}


class TensorBoardSink(Sink):
    """Event files for TensorBoard: scalars under train/ and val/, samples as text.

    A resumed run asks TensorBoard to purge the events a crashed run wrote after the step it
    resumes from (SummaryWriter's purge_step), so the charts show no doubled stretch."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, tags: list[str] = ()):
        self.log_dir, self.tags = Path(log_dir), list(tags)
        self._writer = None

    @classmethod
    def from_config(cls, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict) -> Sink:
        _require("torch.utils.tensorboard", "tensorboard")
        return cls(Path(cfg.tensorboard_dir) if cfg.tensorboard_dir else Path(run_dir) / "tensorboard", cfg.tags)

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=start_step + 1 if purge else None)
        if self.tags:  # TensorBoard has no run tags: a text entry at the session's first step, which
            # a later resume from the same checkpoint purges and writes again (no doubled entry)
            self._writer.add_text("tags", " ".join(f"`{tag}`" for tag in self.tags), global_step=start_step + 1)

    def log(self, step: int, metrics: Metrics) -> None:
        for key, value in _numbers(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()  # once per log interval: visible in TensorBoard right away

    def log_text(self, step: int, name: str, text: str) -> None:
        # TensorBoard renders text as Markdown; a code block keeps the sample's line breaks.
        self._writer.add_text(f"samples/{name}", f"```\n{text}\n```", global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink(Sink):
    """A Weights & Biases run, offline by default (files under <run_dir>/wandb; upload with
    `wandb sync`). Metrics are charted against their own "step" key rather than W&B's
    internal step, which refuses to go back: after a resume from an earlier checkpoint the
    repeated steps are still recorded."""

    name = "wandb"

    def __init__(self, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict):
        self.cfg, self.run_dir, self.run_name, self.config = cfg, Path(run_dir), run_name, config
        self._run = None

    @classmethod
    def from_config(cls, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict) -> Sink:
        _require("wandb", "wandb")
        return cls(cfg, run_dir=run_dir, run_name=run_name, config=config)

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = load_tracking(self.run_dir).get("wandb_run_id") or secrets.token_hex(4)
        self._run = wandb.init(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity, name=self.run_name,
                               id=run_id, resume="allow", dir=str(self.run_dir), config=self.config,
                               mode=self.cfg.wandb_mode, tags=self.cfg.tags or None)
        if self.cfg.wandb_mode != "disabled":
            save_tracking(self.run_dir, wandb_run_id=run_id)
        self._run.define_metric("step")
        # Every group forja logs under (tracker_key, moe/, attn/, health/, eval/, data/, tokens/) is drawn
        # against forja's step.
        for group in ("train/*", "val/*", *(f"{g}/*" for g in names.GROUPS)):
            self._run.define_metric(group, step_metric="step")

    def log(self, step: int, metrics: Metrics) -> None:
        self._run.log({"step": step, **_numbers(metrics)})

    def log_text(self, step: int, name: str, text: str) -> None:
        import wandb

        self._run.log({"step": step, f"samples/{name}": wandb.Table(columns=["step", "text"], data=[[step, text]])})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


# MLflow's limits: characters of a param value, params (or tags) per log_batch call.
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_BATCH_PARAMS = 100


def _mlflow_tags(tags: list[str]) -> dict[str, str]:
    """MLflow's tags are key/value pairs: each run tag is a key with an empty value, so it shows and
    filters as itself (tags.baseline = '') rather than inside one joined string; MetricsConfig
    allows only tags that are valid MLflow keys and not MLflow's or forja's own."""
    return dict.fromkeys(tags, "")


class MLflowSink(Sink):
    """An MLflow run with the flattened config as params and every metric with its step.

    The default store is a SQLite file in the run directory (MLflow 3 refuses the plain
    file store unless MLFLOW_ALLOW_FILE_STORE=true), artifacts (samples) beside it in
    <run_dir>/mlartifacts. MLflow keeps every value it is sent: after a resume from an
    earlier checkpoint the steps in between appear twice in its history."""

    name = "mlflow"

    def __init__(self, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict):
        self.cfg, self.run_dir, self.run_name, self.config = cfg, Path(run_dir).resolve(), run_name, config
        self.tracking_uri = cfg.mlflow_tracking_uri or f"sqlite:///{self.run_dir / 'mlflow.db'}"
        self._client = self.run_id = None

    @classmethod
    def from_config(cls, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict) -> Sink:
        _require("mlflow", "mlflow")
        return cls(cfg, run_dir=run_dir, run_name=run_name, config=config)

    def _open_run(self) -> str:
        saved = load_tracking(self.run_dir)
        if saved.get("mlflow_run_id") and saved.get("mlflow_tracking_uri") == self.tracking_uri:
            self._client.update_run(saved["mlflow_run_id"], status="RUNNING")
            return saved["mlflow_run_id"]
        name = self.cfg.mlflow_experiment
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a local store keeps its artifacts in the run dir, not in the current directory
            artifacts = None if self.cfg.mlflow_tracking_uri else (self.run_dir / "mlartifacts").as_uri()
            experiment_id = self._client.create_experiment(name, artifact_location=artifacts)
        run = self._client.create_run(experiment_id, run_name=self.run_name,
                                      tags={"forja.run_dir": str(self.run_dir)})
        save_tracking(self.run_dir, mlflow_run_id=run.info.run_id, mlflow_tracking_uri=self.tracking_uri)
        return run.info.run_id

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id = self._open_run()
        # Set on resume too: a tag set to the value it has is unchanged, a new one is added.
        tags = [RunTag(key, value) for key, value in _mlflow_tags(self.cfg.tags).items()]
        for i in range(0, len(tags), _MLFLOW_BATCH_PARAMS):
            self._client.log_batch(self.run_id, tags=tags[i:i + _MLFLOW_BATCH_PARAMS])
        # A resumed run has its params already; MLflow refuses to change a logged param.
        logged = self._client.get_run(self.run_id).data.params
        params = [Param(k, v[:_MLFLOW_PARAM_CHARS]) for k, v in flatten(self.config).items() if k not in logged]
        for i in range(0, len(params), _MLFLOW_BATCH_PARAMS):
            self._client.log_batch(self.run_id, params=params[i:i + _MLFLOW_BATCH_PARAMS])

    def log(self, step: int, metrics: Metrics) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in _numbers(metrics).items()]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)

    def log_text(self, step: int, name: str, text: str) -> None:
        self._client.log_text(self.run_id, text, f"samples/{name}/step_{step:08d}.txt")

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id, "FINISHED")
            self._client = None


# Comet settings read when comet_ml is imported: no Sentry error reports (a network call), no
# import hooks that patch torch for auto-logging. setdefault: a user's own COMET_* wins.
_COMET_IMPORT_ENV = {"COMET_ERROR_TRACKING_ENABLE": "false", "COMET_DISABLE_AUTO_LOGGING": "1"}

# Everything Comet would collect by itself (code, git, environment, system metrics, stdout)
# is off: forja logs what it means to, and none of it may reach out or slow a step.
_COMET_QUIET = dict(log_code=False, log_graph=False, auto_param_logging=False, auto_metric_logging=False,
                    parse_args=False, auto_output_logging=False, log_env_details=False, log_git_metadata=False,
                    log_git_patch=False, log_env_gpu=False, log_env_host=False, log_env_cpu=False,
                    log_env_disk=False, display_summary_level=0)


def _import_comet() -> Any:
    for key, value in _COMET_IMPORT_ENV.items():
        os.environ.setdefault(key, value)
    return _require("comet_ml", "comet")


class CometSink(Sink):
    """A Comet ML experiment, always offline: each training session writes one zip archive
    under <run_dir>/comet at close (upload with `comet upload`). A resumed run opens an
    ExistingOfflineExperiment with the saved experiment key; its archive appends to the same
    experiment once the first archive is uploaded. Comet keeps every value it is sent: after
    a resume from an earlier checkpoint the steps in between appear twice."""

    name = "comet"

    def __init__(self, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict):
        self.cfg, self.run_dir, self.run_name, self.config = cfg, Path(run_dir).resolve(), run_name, config
        self.offline_dir = Path(cfg.comet_dir) if cfg.comet_dir else self.run_dir / "comet"
        self._experiment = None

    @classmethod
    def from_config(cls, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict) -> Sink:
        _import_comet()
        return cls(cfg, run_dir=run_dir, run_name=run_name, config=config)

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        comet_ml = _import_comet()
        self.offline_dir.mkdir(parents=True, exist_ok=True)
        common = dict(project_name=self.cfg.comet_project, offline_directory=str(self.offline_dir), **_COMET_QUIET)
        key = load_tracking(self.run_dir).get("comet_experiment_key")
        if key:
            self._experiment = comet_ml.ExistingOfflineExperiment(experiment_key=key, **common)
        else:  # log_env_network is a switch ExistingOfflineExperiment does not take
            self._experiment = comet_ml.OfflineExperiment(log_env_network=False, **common)
            save_tracking(self.run_dir, comet_experiment_key=self._experiment.get_key())
        # Offline, an unnamed experiment gets a generated name at upload time.
        self._experiment.set_name(self.run_name)
        self._experiment.log_other("forja.run_dir", str(self.run_dir))
        if self.cfg.tags:  # in the archive's experiment.json; an upload adds them to the experiment's tags
            self._experiment.add_tags(self.cfg.tags)
        # Logged again on resume: a resumed run may change some (train.steps), and Comet keeps the latest.
        self._experiment.log_parameters(flatten(self.config))

    def log(self, step: int, metrics: Metrics) -> None:
        self._experiment.log_metrics(_numbers(metrics), step=step)

    def log_text(self, step: int, name: str, text: str) -> None:
        self._experiment.log_text(text, step=step, metadata={"name": f"samples/{name}"})

    def close(self) -> None:
        if self._experiment is not None:
            self._experiment.end()  # writes the offline archive
            self._experiment = None
