"""SOAP (the optimizer with the most state: moments, Kronecker factors, eigenbases) resumes
bit for bit from a checkpoint taken between two refreshes of its bases, through the CLI and a
real checkpoint. (That a kill -9 leaves a checkpoint to resume from is test_train.py's.)"""

from __future__ import annotations

import shutil

from forja.cli import main

from .conftest import losses, read_metrics, train_args


def test_soap_resumes_bit_for_bit_between_basis_refreshes(tmp_path, train_data, capsys):
    # precondition_frequency 3: the bases are refreshed at steps 1, 4, 7, 10; the checkpoint of
    # step 8 falls between two refreshes, and the resumed steps cross the next one.
    soap = {"optim.name": '"soap"', "optim.soap.precondition_frequency": "3", "checkpoint.interval": "8",
            "train.steps": "12", "train.val_interval": "0", "train.sample_tokens": "0"}
    reference = tmp_path / "uninterrupted"
    assert main(train_args(reference, train_data, **soap)) == 0
    run = tmp_path / "resumed"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step-00000012")  # as if it had stopped after step 8's checkpoint
    assert main(train_args(run, train_data, **soap)) == 0
    assert f"resumed from {run / 'checkpoints' / 'step-00000008'} (step 8)" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 13))
    assert losses(run) == losses(reference)  # every step, bit for bit
