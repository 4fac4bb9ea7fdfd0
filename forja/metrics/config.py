"""The [metrics] section of a config: how often to log, where to, and the run's tags.

The sink registry lives here as names and "module:class" strings (sinks.py imports each on use),
because config loading may import only the sections' config modules and the section checks its
sinks against the registry.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from forja.errors import ForjaError

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
# The package each tracker imports, and the extra that installs it (pyproject.toml).
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "comet": ("comet_ml", "comet"),
}


def missing_package(sink: str) -> ForjaError:
    module, extra = PACKAGES[sink]
    return ForjaError(f"metrics.sinks includes '{sink}', which needs the {module} package: "
                      f"pip install 'forja[{extra}]' (or remove '{sink}' from metrics.sinks)")


def check_sink_packages(sinks: Sequence[str]) -> None:
    """Every tracker package the sinks need is installed (the preflight's check: found, not
    imported, so that a launch without the package stops before its run directory is written)."""
    import importlib.util

    for sink in (s for s in sinks if s in PACKAGES):
        try:
            found = importlib.util.find_spec(PACKAGES[sink][0]) is not None
        except ImportError:  # an import hook that refuses the name
            found = False
        if not found:
            raise missing_package(sink)

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
