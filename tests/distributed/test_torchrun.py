"""The trainer under torchrun: two CPU processes (Gloo, FSDP over 2 ranks) train the same
model on the same global batches as one process, so the losses match."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from forja.cli import main
from tests.distributed.parity import PARITY_TOL
from tests.integration.conftest import forja_process, losses, read_metrics, train_args, wait_for


def test_two_processes_match_one(tmp_path, train_data):
    steps = {"train.steps": "8", "parallel.timeout_s": "60"}
    single = tmp_path / "single"
    assert main(train_args(single, train_data, **steps)) == 0
    double = tmp_path / "fsdp2"
    # OMP_NUM_THREADS unset, as in a user's shell: each of the 2 processes gets half the cores,
    # although torch read its count in the fork server, before the launch set it.
    proc = forja_process(train_args(double, train_data, **steps) + ["--nproc", "2"], drop_env=["OMP_NUM_THREADS"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    launch = json.loads((double / "run.json").read_text())["launches"][-1]
    assert launch["hardware"]["threads"] == max(1, (os.cpu_count() or 1) // 2)
    a, b = losses(single), losses(double)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    diff = max(abs(a[s] - b[s]) for s in a)
    print(f"FSDP 2 vs 1 process: max |loss difference| over 8 steps = {diff:.2e}")
    assert diff < PARITY_TOL
    # A checkpoint written by 2 ranks resumes in 1 process (DCP reshards it), and continues
    # as the single-process run does.
    more = {**steps, "train.steps": "10"}
    assert main(train_args(double, train_data, **more)) == 0
    assert main(train_args(single, train_data, **more)) == 0
    c, d = losses(single), losses(double)
    assert max(abs(c[s] - d[s]) for s in (9, 10)) < PARITY_TOL


def test_ctrl_c_stops_a_launch_with_one_line_and_exit_130(tmp_path, train_data):
    """Ctrl-C to the terminal's process group of `forja train --nproc 2` (the launcher, its fork
    server, torchrun's agent; the agent passes it on to the workers): while the launcher and
    the fork server import, while the workers set up, and during training. Each ends with
    exit code 130 and one line that says what the run kept, with no traceback from any process
    and none of torchrun's notes on the stop."""
    run = tmp_path / "run"
    args = train_args(run, train_data, **{"train.steps": "100000", "checkpoint.interval": "0",
                                          "parallel.timeout_s": "60"}) + ["--nproc", "2"]
    started = time.monotonic()
    for ready in (lambda: time.monotonic() - started > 1.0,
                  lambda: (run / "config.toml").is_file(),
                  lambda: (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 2):
        # As from a terminal: a test runner's worker may ignore SIGINT, and a child inherits that.
        proc = forja_process(args, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        started = time.monotonic()
        try:
            wait_for(ready, proc)
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 130, out
        assert not any(noise in out for noise in ("Traceback", "death signal", "Closing process", "*****")), out
        said = [line for line in out.splitlines() if "interrupted (Ctrl-C)" in line or "stopped by" in line]
        assert len(said) == 1, out
    assert said[0].startswith("forja train: stopped by Ctrl-C (SIGINT); every process stopped, the run keeps "
                              "step "), said
    step = int(said[0].split("keeps step ")[1].split()[0])
    assert (run / "checkpoints" / f"step-{step:08d}").is_dir() and step >= 2
