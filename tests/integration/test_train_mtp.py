"""Multi-token prediction trained end to end in one process: `forja train` with
model.mtp.depth = 1 logs each depth's loss, trains both losses down, and saves the module."""

from __future__ import annotations

from forja.checkpoint.export import load_checkpoint_model
from forja.cli import main

from .conftest import read_metrics, train_args


def test_mtp_run_logs_its_loss_and_trains(tmp_path, train_data):
    run = tmp_path / "run"
    changes = {"model.family": '"deepseek_v3"', "model.flavor": '"debug"', "model.mtp.depth": "1",
               "train.steps": "10", "train.val_interval": "5", "checkpoint.interval": "10",
               "optim.lr": "3e-3"}
    assert main(train_args(run, train_data, **changes)) == 0
    steps = [r for r in read_metrics(run) if "loss" in r and "mtp/loss_1" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    loss, mtp = [r["loss"] for r in steps], [r["mtp/loss_1"] for r in steps]
    print(f"loss {[round(x, 3) for x in loss]}\nmtp/loss_1 {[round(x, 3) for x in mtp]}")
    assert loss[-1] < loss[0] - 0.5 and mtp[-1] < mtp[0] - 0.5
    assert "mtp/loss_2" not in steps[0]
    model, _ = load_checkpoint_model(run)
    assert model.args.mtp_depth == 1 and list(model.mtp.layers) == ["4"]  # after the debug flavor's 4 layers
