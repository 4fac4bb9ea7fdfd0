"""The rerun of sampled steps (ft.rerun_interval, forja/train/step/rerun.py) in a whole run, one
process: transient faults in a gradient and in a forward are caught, and the run keeps the result
the runs agreed on, so its losses equal those of a run that met no fault and reran nothing, bit for bit."""

from __future__ import annotations

import json

from forja.cli import main

from .conftest import losses, read_metrics, train_args

SHORT = {"train.steps": "4", "train.val_interval": "0", "checkpoint.interval": "0"}


def test_faults_caught_by_the_rerun_leave_the_run_exactly_as_a_clean_one(tmp_path, train_data):
    drilled = tmp_path / "drilled"
    assert main(train_args(drilled, train_data, **SHORT, **{
        "ft.rerun_interval": "2", "debug.inject": json.dumps(["actflip@2", "gradflip@4"])})) == 0
    clean = tmp_path / "clean"
    assert main(train_args(clean, train_data, **SHORT)) == 0
    assert [(r["step"], r["action"]) for r in read_metrics(drilled) if r.get("event") == "rerun"] == [
        (2, "go on"), (4, "go on")]
    assert losses(drilled) == losses(clean)
    assert not any(r.get("event") for r in read_metrics(clean))
