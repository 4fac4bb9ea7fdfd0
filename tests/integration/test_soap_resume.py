"""SOAP (the optimizer with the most state: moments, Kronecker factors, eigenbases) resumes
bit for bit after kill -9, through the CLI and a real checkpoint."""

from __future__ import annotations

from forja.cli import main

from .conftest import kill_then_resume, losses, train_args


def test_soap_kill_9_then_resume_gives_bit_identical_losses(tmp_path, train_data):
    # precondition_frequency 3: the checkpoint at step 8 falls between two basis refreshes (7, 10).
    steps = {"train.steps": "24", "checkpoint.interval": "8", "optim.name": '"soap"',
             "optim.soap.precondition_frequency": "3"}
    reference = tmp_path / "uninterrupted"
    assert main(train_args(reference, train_data, **steps)) == 0

    run = tmp_path / "killed"
    kill_then_resume(run, train_args(run, train_data, **steps), kill_at=8, last=24)
    assert losses(run) == losses(reference)  # every step, bit for bit
