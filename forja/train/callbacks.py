"""Everything around the loop that is not the algorithm, as callbacks.

A callback overrides the hooks it needs; the trainer calls every callback's hook in
order. Hooks get the trainer (as the `TrainerView` below: what a callback may read and
call), so they can read its config and counters; they log through `trainer.log`, never
through each other.
"""

from __future__ import annotations

import gc
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from forja import metric_names as names
from forja.checkpoint.states import TrainerCounters
from forja.config import Config
from forja.metrics.throughput import Throughput, memory_stats, peak_flops
from forja.parallel import ParallelDims
from forja.train.launch.run_dir import report_fallbacks
from forja.train.resilience.stragglers import stragglers


@dataclass
class StepRecord:
    """What one optimizer step did."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time: float
    data_wait: float
    sync_wait: float = 0.0
    """Seconds this rank waited at the step's start for the slower ranks."""
    skipped: bool = False
    replay: bool = False
    """A step trained again after a rollback: the same values as its first run, logged then."""
    extra: dict[str, float] = field(default_factory=dict)
    """The step engine's further figures (a mixture of experts' load)."""


class TrainerView(Protocol):
    """The trainer as callbacks see it (forja/train/trainer.py)."""

    cfg: Config
    rank: int
    run_dir: Path
    device: torch.device
    counters: TrainerCounters
    activation_sizes: dict[str, float]
    model: torch.nn.Module | None
    """The whole model on this rank (None under pipeline parallelism)."""
    tokenizer: Any
    dims: ParallelDims
    max_seq_len: int
    own_dir: Path
    """Where this rank's group keeps its own files (the run directory without [ft])."""
    fallbacks_pending: bool
    """Whether a rank recorded a fallback not reported yet (agreed by every rank at each step)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...
    def log_text(self, step: int, name: str, text: str) -> None: ...
    def gather_floats(self, values: list[float]) -> list[list[float]]: ...
    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None: ...
    def beat(self, phase: str, step: int) -> None: ...
    def sample(self, prompt: str, max_new_tokens: int) -> str | None: ...
    def request_stop(self, reason: str) -> None: ...


class Callback:
    def on_train_start(self, trainer: TrainerView) -> None: ...
    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None: ...
    def on_validation_end(self, trainer: TrainerView, step: int, val_loss: float) -> None: ...
    def on_checkpoint(self, trainer: TrainerView, step: int, path: Path) -> None: ...
    def on_train_end(self, trainer: TrainerView) -> None: ...
    def close(self) -> None: ...


class MetricsCallback(Callback):
    """Step metrics every `metrics.interval` steps (loss, lr, gradient norm, throughput,
    MFU, memory) and validation losses, logged through the trainer. Throughput is averaged
    over the steps since the last log."""

    def __init__(self, *, flops_per_token: int, num_devices: int, device: torch.device,
                 compute_dtype: torch.dtype, interval: int, peak_tflops: float | None = None):
        self.device = device
        self.interval = max(1, interval)
        # A peak given in the config wins over the table (a GPU the table does not know).
        peak = peak_tflops * 1e12 if peak_tflops else peak_flops(device, compute_dtype)
        self.throughput = Throughput(flops_per_token=flops_per_token, num_devices=num_devices, peak_flops=peak)

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        if record.replay:
            return
        self.throughput.update(tokens=record.tokens, step_time=record.step_time, data_wait=record.data_wait)
        if record.step % self.interval and record.step != trainer.cfg.train.steps:
            return
        metrics = {names.LOSS: record.loss, names.LR: record.lr, names.GRAD_NORM: record.grad_norm,
                   names.TOKENS_SEEN: trainer.counters.tokens_seen, **self.throughput.compute(),
                   **memory_stats(self.device), **record.extra}
        if trainer.counters.skipped_steps:
            metrics[names.SKIPPED_STEPS] = trainer.counters.skipped_steps
        trainer.log(record.step, metrics)

    def on_validation_end(self, trainer: TrainerView, step: int, val_loss: float) -> None:
        loader = getattr(trainer, "loader", None)  # the data stage the model has reached, as on step records
        stage = {names.STAGE: loader.stage} if hasattr(loader, "stage") else {}
        trainer.log(step, {names.VAL_LOSS: val_loss, **stage, **trainer.activation_sizes})


class SampleCallback(Callback):
    """Writes a short generated sample to <run.dir>/samples.txt at the end of training."""

    def on_train_end(self, trainer: TrainerView) -> None:
        cfg = trainer.cfg.train
        if cfg.sample_tokens <= 0:
            return
        text = trainer.sample(cfg.sample_prompt, cfg.sample_tokens)
        if text is not None and trainer.rank == 0:
            with open(trainer.run_dir / "samples.txt", "a", encoding="utf-8") as f:
                f.write(f"--- step {trainer.counters.step}, prompt {cfg.sample_prompt!r}, greedy ---\n{text}\n\n")
            trainer.log_text(trainer.counters.step, "sample", text)


class GCCallback(Callback):
    """Python's garbage collector at fixed steps instead of whenever it likes: a full
    collection in the middle of a step stalls every rank waiting on this one."""

    def __init__(self, interval: int):
        self.interval = interval

    def on_train_start(self, trainer: TrainerView) -> None:
        if self.interval > 0:
            gc.disable()
            gc.collect(1)

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        if self.interval > 0 and record.step % self.interval == 0:
            gc.collect(1)

    def close(self) -> None:
        gc.enable()


class ProfilerCallback(Callback):
    """A `torch.profiler` trace of a few steps from `start_step`, to <run.dir>/profile/."""

    def __init__(self, start_step: int, steps: int = 3):
        self.start_step, self.steps = start_step, steps
        self.prof = None

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        if record.step == self.start_step - 1:
            out = trainer.run_dir / "profile"
            self.prof = torch.profiler.profile(
                record_shapes=True, with_stack=False,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), worker_name=f"rank{trainer.rank}"))
            self.prof.__enter__()
        elif self.prof is not None and record.step >= self.start_step + self.steps - 1:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None


class PreemptionCallback(Callback):
    """SIGTERM (a scheduler's preemption) or Ctrl-C asks the trainer to stop after the
    current step; the trainer then saves a checkpoint and exits cleanly. A second Ctrl-C
    interrupts at once."""

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.requested_at: float | None = None

    def on_train_start(self, trainer: TrainerView) -> None:
        def handler(signum, _frame):
            trainer.request_stop(signal.Signals(signum).name)
            self.requested_at = time.monotonic()
            # The next Ctrl-C raises as it did before (`forja`'s own Interrupted, forja/cli.py).
            before = self.previous.get(signal.SIGINT)
            signal.signal(signal.SIGINT, before if callable(before) else signal.default_int_handler)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals stay with the host program
                pass

    def close(self) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous.clear()


class RunSummaryCallback(Callback):
    """The last lines of a run that finished: its last losses, where its model is, and the next
    commands to run on it, each ready to paste (printed by the process that logged the steps)."""

    def __init__(self) -> None:
        self.loss: float | None = None
        self.val_loss: float | None = None
        self.checkpoint: Path | None = None

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        self.loss = record.loss

    def on_validation_end(self, trainer: TrainerView, step: int, val_loss: float) -> None:
        self.val_loss = val_loss

    def on_checkpoint(self, trainer: TrainerView, step: int, path: Path) -> None:
        self.checkpoint = path

    def on_train_end(self, trainer: TrainerView) -> None:
        if trainer.rank != 0 or self.loss is None:  # [ft]: a group that recorded no step says nothing
            return
        run = shlex.quote(str(trainer.cfg.run.dir))
        losses = f"loss {self.loss:.4f}" + (f", val_loss {self.val_loss:.4f}" if self.val_loss is not None else "")
        lines = [f"forja: done at step {trainer.counters.step} ({losses}); the run is in {run}"]
        if self.checkpoint is None:
            lines.append("  no checkpoint was saved (checkpoint.enabled = false): there is no model to export")
        else:
            steps = [(f"forja generate {run} --prompt 'def '", "continue a prompt"),
                     (f"forja export {run} --hf {run}/hf", "a Hugging Face model directory"),
                     (f"forja report {run}", "its curves and figures")]
            why = _not_exportable(trainer)
            if why is not None:  # suggest no export that would refuse
                steps.pop(1)
            width = max(len(command) for command, _ in steps)
            lines += [f"  its model: {self.checkpoint}", "  next:"]
            lines += [f"    {command.ljust(width)}  # {what}" for command, what in steps]
            if why is not None:
                lines.append(f"  no Hugging Face export: {why}")
        print("\n".join(lines), flush=True)


def _not_exportable(trainer: TrainerView) -> str | None:
    """Why `forja export --hf` would refuse this run's model (its family's adapter says), or None."""
    from forja.errors import ForjaError
    from forja.models.config import run_model_args
    from forja.models.registry import spec_of

    try:
        args = run_model_args(trainer.cfg.model, trainer.tokenizer.vocab_size)
        spec_of(args).hf.config_from_args(args)
    except ForjaError as e:
        return str(e)
    return None


class StragglerCallback(Callback):
    """Names the ranks that make the others wait (forja/train/resilience/stragglers.py says how)."""

    def __init__(self, *, interval: int, factor: float):
        self.interval, self.factor = max(1, interval), factor
        self._since = time.perf_counter()
        self._wait = self._data = 0.0
        self._steps = 0
        self._warm = False

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        if not self._warm:  # a launch's first step (allocation, compilation) is no rank's fault
            self._warm, self._since = True, time.perf_counter()
            return
        self._wait += record.sync_wait
        self._data += record.data_wait
        self._steps += 1
        if record.step % self.interval:
            return
        busy = (time.perf_counter() - self._since - self._wait) / self._steps
        gathered = trainer.gather_floats([busy, self._data / self._steps])  # one small collective
        self._since, self._wait, self._data, self._steps = time.perf_counter(), 0.0, 0.0, 0
        if len(gathered) < 2:
            return
        busy_all = [g[0] for g in gathered]
        median = statistics.median_low(busy_all)
        for r in stragglers(busy_all, self.factor):
            trainer.log(record.step, {"event": "straggler", "health/rank": r, "health/busy_s": busy_all[r],
                                      "health/busy_median_s": median, "health/data_wait_s": gathered[r][1]})
            if trainer.rank == 0:
                print(f"forja: straggler at step {record.step}: rank {r} is busy {busy_all[r]:.3f} s per step, "
                      f"{busy_all[r] / median:.1f}x the median {median:.3f} s (its data wait: "
                      f"{gathered[r][1]:.3f} s per step)", file=sys.stderr, flush=True)


class FallbackCallback(Callback):
    """The fallbacks first recorded while the launch's first step ran (a fused op deciding at
    its first call, on the tensors it gets) are printed and added to run.json right after it,
    and any recorded later after the step whose agreement found them (`fallbacks_pending`, the
    same on every rank); those recorded while the model was built were reported before step 1."""

    def __init__(self) -> None:
        self._first = True

    def on_step_end(self, trainer: TrainerView, record: StepRecord) -> None:
        if self._first or trainer.fallbacks_pending:  # every rank alike: the gather is collective
            self._first = False
            report_fallbacks(trainer.own_dir, rank=trainer.rank, group=trainer.dims.cpu_group)


def default_callbacks(cfg: Config, *, flops_per_token: int, num_devices: int, device: torch.device,
                      compute_dtype: torch.dtype | None) -> list[Callback]:
    """The callbacks every run has, from its config."""
    metrics = MetricsCallback(flops_per_token=flops_per_token, num_devices=num_devices, device=device,
                              compute_dtype=compute_dtype or torch.float32, interval=cfg.metrics.interval,
                              peak_tflops=cfg.metrics.peak_tflops)
    callbacks: list[Callback] = [metrics, SampleCallback(), GCCallback(cfg.train.gc_interval), PreemptionCallback(),
                                 FallbackCallback(), RunSummaryCallback()]
    if num_devices > 1 and cfg.metrics.straggler_factor > 0:
        callbacks.append(StragglerCallback(interval=cfg.metrics.interval, factor=cfg.metrics.straggler_factor))
    if cfg.train.profile_at > 0:
        callbacks.append(ProfilerCallback(cfg.train.profile_at))
    return callbacks
