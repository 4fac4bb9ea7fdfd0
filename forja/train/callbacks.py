"""Everything around the loop that is not the algorithm, as callbacks.

A callback overrides the hooks it needs; the trainer calls every callback's hook in
order. Hooks get the trainer, so they can read its config, model and counters.
"""

from __future__ import annotations

import gc
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forja.metrics.throughput import Throughput, memory_stats, peak_flops

if TYPE_CHECKING:
    from forja.train.trainer import Trainer


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
    skipped: bool = False


class Callback:
    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None: ...
    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None: ...
    def on_checkpoint(self, trainer: Trainer, step: int, path: Path) -> None: ...
    def on_train_end(self, trainer: Trainer) -> None: ...
    def close(self) -> None: ...


class MetricsCallback(Callback):
    """Feeds the metric sinks: step metrics every `metrics.interval` steps, validation,
    samples. Throughput is averaged over the steps since the last log."""

    def __init__(self, sinks, *, flops_per_token: int, num_devices: int, device: torch.device,
                 compute_dtype: torch.dtype, interval: int, peak_tflops: float | None = None):
        self.sinks = sinks
        self.device = device
        self.interval = max(1, interval)
        # A peak given in the config wins over the table (a GPU the table does not know).
        peak = peak_tflops * 1e12 if peak_tflops else peak_flops(device, compute_dtype)
        self.throughput = Throughput(flops_per_token=flops_per_token, num_devices=num_devices, peak_flops=peak)

    def on_train_start(self, trainer: Trainer) -> None:
        self.sinks.start(total_steps=trainer.cfg.train.steps, start_step=trainer.counters.step)

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        self.throughput.update(tokens=record.tokens, step_time=record.step_time, data_wait=record.data_wait)
        if record.step % self.interval and record.step != trainer.cfg.train.steps:
            return
        metrics = {"loss": record.loss, "lr": record.lr, "grad_norm": record.grad_norm,
                   "tokens_seen": trainer.counters.tokens_seen, **self.throughput.compute(),
                   **memory_stats(self.device)}
        if trainer.counters.skipped_steps:
            metrics["skipped_steps"] = trainer.counters.skipped_steps
        self.sinks.log(record.step, metrics)

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        self.sinks.log(step, {"val_loss": val_loss})

    def close(self) -> None:
        self.sinks.close()


class SampleCallback(Callback):
    """Writes a short generated sample to <run.dir>/samples.txt at the end of training."""

    def on_train_end(self, trainer: Trainer) -> None:
        cfg = trainer.cfg.train
        if cfg.sample_tokens <= 0:
            return
        text = trainer.sample(cfg.sample_prompt, cfg.sample_tokens)
        if text is not None and trainer.rank == 0:
            with open(trainer.run_dir / "samples.txt", "a", encoding="utf-8") as f:
                f.write(f"--- step {trainer.counters.step}, prompt {cfg.sample_prompt!r}, greedy ---\n{text}\n\n")
            for cb in trainer.callbacks:
                if isinstance(cb, MetricsCallback):
                    cb.sinks.log_text(trainer.counters.step, "sample", text)


class GCCallback(Callback):
    """Python's garbage collector at fixed steps instead of whenever it likes: a full
    collection in the middle of a step stalls every rank waiting on this one."""

    def __init__(self, interval: int):
        self.interval = interval

    def on_train_start(self, trainer: Trainer) -> None:
        if self.interval > 0:
            gc.disable()
            gc.collect(1)

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        if self.interval > 0 and record.step % self.interval == 0:
            gc.collect(1)

    def close(self) -> None:
        gc.enable()


class ProfilerCallback(Callback):
    """A `torch.profiler` trace of a few steps from `start_step`, to <run.dir>/profile/."""

    def __init__(self, start_step: int, steps: int = 3):
        self.start_step, self.steps = start_step, steps
        self.prof = None

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
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

    def on_train_start(self, trainer: Trainer) -> None:
        def handler(signum, _frame):
            trainer.request_stop(signal.Signals(signum).name)
            self.requested_at = time.monotonic()
            signal.signal(signal.SIGINT, signal.default_int_handler)

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals stay with the host program
                pass

    def close(self) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous.clear()
