"""Where training metrics go: the [metrics] config, the `Sink` interface, the JSONL sink and
`build_sinks`, which turns the config into a `SinkGroup` the trainer logs to.

    sinks = build_sinks(cfg.metrics, run_dir=run_dir, run_name=name, config=cfg_dict, rank=rank)
    sinks.start(total_steps=cfg.train.steps, start_step=step)
    sinks.log(step, {"loss": 3.1, "lr": 3e-4, "tokens_per_sec": 52_000.0, "mfu": None})
    sinks.log(step, {"val_loss": 3.3})
    sinks.log_text(step, "sample", text)
    sinks.close()

Only rank 0 gets real sinks. A sink that fails is reported once and never stops training.
The console sink lives in console.py, TensorBoard, W&B, MLflow and Comet in trackers.py; their
libraries are imported only when chosen.
"""

from __future__ import annotations

import abc
import importlib
import json
import posixpath
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from forja.errors import ForjaError
from forja.files import write_atomic

Metrics = Mapping[str, float | int | None]

# The sink registry: name -> "module:class", imported on use, so choosing the console does not
# import wandb. A new sink is a `Sink` subclass (built by its `from_config`) added here.
SINKS: dict[str, str] = {
    "console": "forja.metrics.console:ConsoleSink",
    "jsonl": "forja.metrics.sinks:JsonlSink",
    "tensorboard": "forja.metrics.trackers:TensorBoardSink",
    "wandb": "forja.metrics.trackers:WandbSink",
    "mlflow": "forja.metrics.trackers:MLflowSink",
    "comet": "forja.metrics.trackers:CometSink",
}
WANDB_MODES = ("offline", "online", "disabled")

# What every tracker accepts as a run tag: W&B takes 1 to 64 characters (wandb_settings.py); MLflow
# stores each tag as a tag key (trackers.py), which may hold only letters, digits, _ - . / : and spaces
# and must read as one path (mlflow/utils/validation.py); mlflow.* and forja.* are the run's own tags.
TAG_CHARS = 64
_TAG_PATTERN = re.compile(r"[\w.\-/: ]+")
_RESERVED_TAG_PREFIXES = ("mlflow.", "forja.")


def _tag_problem(tag: Any) -> str | None:
    """Why `tag` is refused as a run tag, or None."""
    if not isinstance(tag, str):
        return "is not a string"
    if not 1 <= len(tag) <= TAG_CHARS:
        return f"has {len(tag)} characters; a tag has 1 to {TAG_CHARS} (W&B's limit)"
    if not _TAG_PATTERN.fullmatch(tag) or tag != tag.strip():
        return "may hold only letters, digits, _ - . / : and inner spaces (MLflow's tag keys)"
    norm = posixpath.normpath(tag)  # MLflow's path_not_unique
    if norm != tag or norm == "." or norm.startswith(("..", "/")):
        return "must read as one path: no leading, trailing or doubled /, no . or .. parts (MLflow's tag keys)"
    if tag.startswith(_RESERVED_TAG_PREFIXES):
        return "starts with 'mlflow.' or 'forja.', which name MLflow's and forja's own run tags"
    return None


@dataclass(kw_only=True)
class MetricsConfig:
    """The [metrics] section: how often to log and where to."""

    interval: int = 10
    """Log the training metrics every this many optimizer steps."""
    sinks: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Where to log: any of console, jsonl, tensorboard, wandb, mlflow, comet."""
    wandb_project: str = "kode-pretraining"
    """W&B project of the run."""
    wandb_mode: str = "offline"
    """offline (written under <run_dir>/wandb, upload later with `wandb sync`), online, or disabled."""
    wandb_entity: str | None = None
    """W&B team or user; None is the default entity of the logged-in account."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or database; None is a SQLite file, sqlite:///<run_dir>/mlflow.db."""
    mlflow_experiment: str = "kode-pretraining"
    """MLflow experiment the run belongs to (created when missing)."""
    tensorboard_dir: str | None = None
    """Directory of the TensorBoard event files; None is <run_dir>/tensorboard."""
    comet_project: str = "kode-pretraining"
    """Comet ML project of the run (Comet runs offline: upload the archives later with `comet upload`)."""
    comet_dir: str | None = None
    """Directory of the Comet offline archives; None is <run_dir>/comet."""
    straggler_factor: float = 1.5
    """A rank busier than this many times the median rank is named as a straggler in the log, checked
    every interval (forja/train/resilience/stragglers.py); 0 turns it off."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device, for MFU on hardware the built-in table does not know
    (or to override it); None uses the table, and no MFU where the table has no entry."""
    tags: list[str] = field(default_factory=list)
    """Run tags for W&B, MLflow (each a tag key with an empty value) and Comet, and a text entry in
    TensorBoard; each 1-64 characters of letters, digits, _ - . / : and inner spaces. On resume W&B's
    run takes the config's tags (unless empty), MLflow and Comet add them to the run's."""

    def __post_init__(self) -> None:
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ForjaError(f"metrics.interval = {self.interval!r} must be a whole number of steps, at least 1")
        if isinstance(self.sinks, str) or not isinstance(self.sinks, Sequence):
            raise ForjaError(f"metrics.sinks = {self.sinks!r} must be a list, such as [\"console\", \"jsonl\"]")
        for name in self.sinks:
            if name not in SINKS:
                raise ForjaError(f"metrics.sinks: unknown sink {name!r}; choose from {', '.join(SINKS)}")
        if len(set(self.sinks)) != len(self.sinks):
            raise ForjaError(f"metrics.sinks = {list(self.sinks)} names a sink twice; name each once")
        self.sinks = list(self.sinks)
        if self.wandb_mode not in WANDB_MODES:
            raise ForjaError(f"metrics.wandb_mode = {self.wandb_mode!r} is not one of {', '.join(WANDB_MODES)}")
        for key in ("wandb_project", "mlflow_experiment", "comet_project"):
            if not getattr(self, key):
                raise ForjaError(f"metrics.{key} is empty; give it a name such as 'kode-pretraining'")
        if self.straggler_factor != 0 and not self.straggler_factor > 1:
            raise ForjaError(f"metrics.straggler_factor = {self.straggler_factor} must be > 1, or 0 to turn it off")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ForjaError(f"metrics.peak_tflops = {self.peak_tflops} must be > 0, or left out to use the table")
        self._check_tags()

    def _check_tags(self) -> None:
        if isinstance(self.tags, str) or not isinstance(self.tags, Sequence):
            raise ForjaError(f"metrics.tags = {self.tags!r} must be a list of strings, "
                             "such as [\"baseline\", \"lr-3e-4\"]")
        for tag in self.tags:
            if problem := _tag_problem(tag):
                raise ForjaError(f"metrics.tags: {tag!r} {problem}; change or remove it "
                                 "(tags such as \"baseline\" or \"ablation/lr-3e-4\" suit every tracker)")
        if len(set(self.tags)) != len(self.tags):
            raise ForjaError(f"metrics.tags = {list(self.tags)} names a tag twice; name each once")
        self.tags = list(self.tags)


class Sink(abc.ABC):
    """One destination of metrics. Values of None mean "not measured" (an MFU without a
    known peak): a sink that cannot store a missing value skips it."""

    name: ClassVar[str] = "sink"

    @classmethod
    def from_config(cls, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict) -> Sink:
        """Build the sink for a run; `config` is the run's resolved config as a plain dict."""
        return cls()

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        """Open the destination. `start_step` > 0 when resuming: the run has done that many steps.
        `purge`: what a crashed run recorded beyond `start_step` is dropped (it is trained again).
        False for an [ft] replica group that rejoins a live run: its peers' records stand."""

    @abc.abstractmethod
    def log(self, step: int, metrics: Metrics) -> None:
        """Record `metrics` at optimizer step `step`. Validation comes as keys `val_*`."""

    def log_text(self, step: int, name: str, text: str) -> None:
        """Record a piece of text, such as a generated sample, at `step`."""

    def close(self) -> None:
        """Flush and release the destination."""


def tracker_key(name: str) -> str:
    """The name a metric gets in a tracker with grouped charts: val_loss -> val/loss,
    loss -> train/loss. A name that already holds a '/' is kept."""
    if "/" in name:
        return name
    if name.startswith("val_"):
        return "val/" + name[len("val_"):]
    return "train/" + name


def _plain(value: Any) -> float | int | None:
    """A tensor or NumPy scalar as a Python number, so every sink gets the same thing."""
    if value is None or isinstance(value, (int, float)):
        return value
    try:
        return value.item() if hasattr(value, "item") else float(value)
    except Exception:  # not a number: passed on as it is, for each sink to take or report
        return value


class SinkGroup(Sink):
    """Sends every call to each of its sinks. A sink that raises is reported once (a
    RuntimeWarning naming it and the error) and the others go on; one that fails to start
    is turned off for the rest of the run."""

    name = "group"

    def __init__(self, sinks: Sequence[Sink] = ()):
        self.sinks = list(sinks)
        self._active = list(self.sinks)
        self._warned: set[int] = set()

    def __len__(self) -> int:
        return len(self._active)

    def _call(self, sink: Sink, method: str, *args: Any, **kwargs: Any) -> bool:
        try:
            getattr(sink, method)(*args, **kwargs)
            return True
        except Exception as exc:  # a broken logger must never stop a training run
            if id(sink) not in self._warned:
                self._warned.add(id(sink))
                what = ("it is turned off for this run" if method == "start"
                        else "training goes on; further errors of this sink are not shown")
                warnings.warn(f"metrics sink '{sink.name}' failed in {method}(): "
                              f"{type(exc).__name__}: {exc}; {what}", RuntimeWarning, stacklevel=3)
            return False

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        self._active = [s for s in self.sinks if self._call(s, "start", total_steps=total_steps,
                                                            start_step=start_step, purge=purge)]

    def log(self, step: int, metrics: Metrics) -> None:
        plain = {key: _plain(value) for key, value in metrics.items()}
        for sink in self._active:
            self._call(sink, "log", step, plain)

    def log_text(self, step: int, name: str, text: str) -> None:
        for sink in self._active:
            self._call(sink, "log_text", step, name, text)

    def close(self) -> None:
        for sink in self._active:
            self._call(sink, "close")
        self._active = []


def drop_after(path: Path, step: int) -> int:
    """Remove the lines of a JSONL file whose "step" is beyond `step`, and a torn last line;
    return how many went. Events (records with an "event": a rollback, a skipped step) stay:
    they happened, even if the steps around them are trained again. The file is rewritten whole and renamed into place."""
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8")
    kept, dropped = [], 0
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the last run died
            dropped += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) > step and "event" not in record:
            dropped += 1
        else:
            kept.append(line)
    if dropped or (text and not text.endswith("\n")):
        write_atomic(path, "".join(line + "\n" for line in kept))
    return dropped


class JsonlSink(Sink):
    """<run_dir>/metrics.jsonl: one JSON object per `log` call, {"step": s, "time": unix_s,
    ...metrics}, None as null, a NaN loss as NaN (Python's json and pandas read it back).
    Text goes to <run_dir>/samples.jsonl as {"step", "time", "name", "text"}, keeping the
    metrics file all numbers. A resumed run appends, after dropping what a crashed run wrote
    beyond the checkpoint it resumes from, so no step appears twice."""

    name = "jsonl"

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"

    @classmethod
    def from_config(cls, cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict) -> Sink:
        return cls(run_dir)

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if purge:
            for path in (self.path, self.samples_path):
                drop_after(path, start_step)

    @staticmethod
    def _append(path: Path, record: dict) -> None:
        # Opened for each record: a file rewritten meanwhile (an [ft] group that resumed and
        # purged it) is written to under its name, not through a handle on the replaced one.
        # A record reaches the OS as it is written, so a crash loses none.
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, step: int, metrics: Metrics) -> None:
        self._append(self.path, {"step": step, "time": round(time.time(), 3), **metrics})

    def log_text(self, step: int, name: str, text: str) -> None:
        self._append(self.samples_path, {"step": step, "time": round(time.time(), 3), "name": name, "text": text})


def sink_class(name: str) -> type[Sink]:
    module_name, class_name = SINKS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_sinks(cfg: MetricsConfig, *, run_dir: Path, run_name: str, config: dict, rank: int) -> SinkGroup:
    """The sinks of `cfg.sinks` for this process: all of them on rank 0, none elsewhere.

    `config` is the run's resolved config as a plain dict (logged by W&B and MLflow). A sink
    whose library is missing stops here, before any training, with the pip extra to install.
    """
    if rank != 0:
        return SinkGroup([])
    run_dir = Path(run_dir)
    return SinkGroup([sink_class(name).from_config(cfg, run_dir=run_dir, run_name=run_name, config=config)
                      for name in cfg.sinks])
