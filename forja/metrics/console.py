"""The console sink: a progress bar on a terminal, one plain line per log anywhere else.

A terminal shows a rich progress bar (step/total, loss, tokens/s, ETA) with each log line
printed above it. When the output is a file or a pipe (a cluster job's log, `| tee`), a bar
would fill the log with control codes, so each log is one line of plain text instead:

    step 120/1000 | loss 3.2104 | lr 3.00e-04 | grad_norm 0.912 | 48,211 tok/s | mfu 41.3% | eta 0:12:31
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from forja import metric_names as names
from forja.metrics.sinks import Metrics, Sink


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


# The keys a log line shows, in this order, and how; every key is in metrics.jsonl anyway.
_FORMATS: dict[str, Callable[[float], str]] = {
    names.STAGE: lambda v: f"stage {int(v)}",
    names.LOSS: lambda v: f"loss {v:.4f}",
    names.VAL_LOSS: lambda v: f"val_loss {v:.4f}",
    names.LR: lambda v: f"lr {v:.2e}",
    names.GRAD_NORM: lambda v: f"grad_norm {v:.3f}",
    names.TOKENS_PER_SEC: lambda v: f"{v:,.0f} tok/s",
    names.TFLOPS: lambda v: f"{v:.1f} TFLOP/s",
    names.MFU: lambda v: f"mfu {_pct(v)}",
    names.MEM_PEAK_GB: lambda v: f"mem {v:.1f} GB",
    names.STEP_TIME: lambda v: f"{v:.3f} s/step",
    names.DATA_WAIT_FRAC: lambda v: f"data_wait {_pct(v)}",
}


def format_metrics(metrics: Metrics) -> list[str]:
    """The shown metrics as 'name value' strings; other val_* keys follow in their order."""
    parts = [fmt(metrics[key]) for key, fmt in _FORMATS.items()
             if metrics.get(key) is not None and (key != names.STAGE or metrics[key])]  # stage 0: said by nothing
    for key, value in metrics.items():
        if key.startswith(names.VAL_PREFIX) and key not in _FORMATS and value is not None:
            parts.append(f"{key} {value:.4g}")
    return parts


class ConsoleSink(Sink):
    """Progress on the console (stdout unless given another rich Console)."""

    name = "console"

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self._progress: Progress | None = None
        self._total = self._start_step = 0
        self._t0, self._first = time.monotonic(), None

    def start(self, *, total_steps: int, start_step: int, purge: bool = True) -> None:
        self._total, self._start_step = total_steps, start_step
        self._t0, self._first = time.monotonic(), None
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), console=self.console)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()

    def _eta(self, step: int) -> str | None:
        # Timed from the first log on, so start-up and compilation do not inflate the estimate.
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
        t0, step0 = self._first if step > self._first[1] else (self._t0, self._start_step)
        if step <= step0 or step >= self._total:
            return None
        seconds = (now - t0) / (step - step0) * (self._total - step)
        return str(datetime.timedelta(seconds=round(seconds)))

    def log(self, step: int, metrics: Metrics) -> None:
        parts = format_metrics(metrics)
        if not parts:
            return  # an event or a summary: it comes as text (log_text) or at the end of the run
        is_train = any(not key.startswith("val_") for key in metrics)
        eta = self._eta(step) if is_train else None
        if eta is not None:
            parts.append(f"eta {eta}")
        line = " | ".join([f"step {step}/{self._total}", *parts])
        if self._progress is None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        if is_train:
            short = [p for p in parts if p.startswith(("loss ", "eta ")) or p.endswith(" tok/s")]
            self._progress.update(self._task, completed=step, stats=" | ".join(short))

    def log_text(self, step: int, name: str, text: str) -> None:
        self.console.print(f"--- {name} at step {step} ---\n{text}", markup=False, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
