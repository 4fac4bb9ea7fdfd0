"""A mixture of experts trained end to end in one process: its load metrics reach
metrics.jsonl and the trackers, and the auxiliary-loss-free bias moves and is saved."""

from __future__ import annotations

import pytest
import torch

from forja.checkpoint.export import load_checkpoint_model
from forja.cli import main
from tests.trackers import read_tensorboard

from .conftest import read_metrics, train_args

MOE_KEYS = ("moe/load_max_mean", "moe/load_cv", "moe/dropped", "moe/aux_loss", "moe/z_loss")


def test_moe_metrics_reach_jsonl_and_tensorboard(tmp_path, train_data):
    run = tmp_path / "run"
    changes = {"model.family": '"qwen3"', "model.flavor": '"debug-moe"', "train.steps": "4",
               "metrics.sinks": '["jsonl", "tensorboard"]', "train.val_interval": "0",
               "model.overrides": "{aux_loss_weight=0.01, z_loss_weight=0.001, capacity_factor=1.0}"}
    assert main(train_args(run, train_data, **changes)) == 0
    steps = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert all(key in record for key in MOE_KEYS), sorted(record)
        assert record["moe/load_max_mean"] >= 1.0 and record["moe/load_cv"] >= 0
        assert 0 < record["moe/dropped"] < 1  # a capacity factor of 1 drops some slots at random init
        assert record["moe/aux_loss"] > 0.9  # 1 when balanced, more otherwise
        assert "moe/layer0/load_cv" not in record and "moe/layer1/load_cv" in record  # layer 0 is dense
    tb = read_tensorboard(run / "tensorboard")
    assert [e.step for e in tb.Scalars("moe/load_cv")] == [1, 2, 3, 4]
    assert [e.value for e in tb.Scalars("moe/layer3/dropped")] == [
        pytest.approx(r["moe/layer3/dropped"]) for r in steps]


def test_aux_free_bias_moves_and_is_saved_with_the_weights(tmp_path, train_data):
    run = tmp_path / "run"
    changes = {"model.family": '"deepseek_v3"', "model.flavor": '"debug"', "train.steps": "3",
               "train.val_interval": "0", "checkpoint.interval": "3",
               "model.overrides": "{bias_update_rate=0.01}"}
    assert main(train_args(run, train_data, **changes)) == 0
    model, _ = load_checkpoint_model(run)
    bias = model.layers["1"].feed_forward.router.expert_bias
    assert bias.dtype == torch.float32
    # Three sign steps of 0.01 from zero: each expert's bias is a multiple of 0.01, not all 0.
    assert bias.abs().max() > 0
    torch.testing.assert_close(bias * 100, (bias * 100).round(), atol=1e-4, rtol=0)
