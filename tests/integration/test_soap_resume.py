"""SOAP (the optimizer with the most state: moments, Kronecker factors, eigenbases) resumes
bit for bit after kill -9, through the CLI and a real checkpoint."""

from __future__ import annotations

import time

from forja.cli import main

from .conftest import forja_process, losses, train_args


def test_soap_kill_9_then_resume_gives_bit_identical_losses(tmp_path, train_data):
    # precondition_frequency 3: the checkpoint at step 8 falls between two basis refreshes (7, 10).
    steps = {"train.steps": "24", "checkpoint.interval": "8", "optim.name": '"soap"',
             "optim.soap.precondition_frequency": "3"}
    reference = tmp_path / "uninterrupted"
    assert main(train_args(reference, train_data, **steps)) == 0

    run = tmp_path / "killed"
    proc = forja_process(train_args(run, train_data, **steps))
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step-00000008").is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    assert not (run / "checkpoints" / "step-00000024").exists(), "the run finished before it was killed"

    resumed = forja_process(train_args(run, train_data, **steps))
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resumed from" in out
    assert losses(run) == losses(reference)  # every step, bit for bit
