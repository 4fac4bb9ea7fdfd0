"""Where training metrics go: the `Sink` interface, the JSONL sink and `build_sinks`, which
turns the [metrics] config (config.py) into a `SinkGroup` the trainer logs to.

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
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from forja.files import write_atomic
from forja.metrics.config import SINKS, MetricsConfig

Metrics = Mapping[str, float | int | None]


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
    they happened, even if the steps around them are trained again. The file is rewritten whole and renamed into
    place."""
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
