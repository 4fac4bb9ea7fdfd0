"""Async checkpoints of a state on CUDA (skipped without one): staged into pinned host memory,
a snapshot at save time, loaded back onto the GPU bit for bit."""

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager, staging_options
from forja.checkpoint.states import ModelState, OptimizerState
from forja.models import build_model
from forja.parallel.process_group import init_distributed, shutdown_distributed


@pytest.fixture
def process_group():
    init_distributed("cuda")  # as one-GPU training has it: Gloo for CPU tensors, NCCL for CUDA ones
    yield
    shutdown_distributed()


def _state(seed: int):
    model = build_model("llama", "debug", seed=seed).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long, device="cuda")).sum().backward()
    opt.step()
    return model, {"model": ModelState(model), "optim": OptimizerState(model, opt)}


def test_staging_from_cuda_lands_in_pinned_host_memory():
    weights = torch.randn(1024, 1024, device="cuda")
    stager = DefaultStager(staging_options(weights.device))
    try:
        staged = stager.stage({"w": weights})
        assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
        assert torch.equal(staged["w"], weights.cpu())
    finally:
        stager.close()


def test_async_save_from_cuda_round_trips(tmp_path, process_group):
    manager = CheckpointManager(CheckpointConfig(async_save=True), tmp_path, device="cuda")
    model, state = _state(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(1, state)
    with torch.no_grad():  # training goes on in place while the write is in flight
        for p in model.parameters():
            p.add_(1.0)
    assert manager.wait() == manager.latest()
    other, other_state = _state(2)
    manager.load(manager.latest(), other_state)
    for name, value in other.state_dict().items():
        assert value.device.type == "cuda" and torch.equal(value, saved[name]), name
    loaded, kept = (s["optim"].optimizers[0].state_dict()["state"][0]["exp_avg"] for s in (other_state, state))
    assert loaded.device.type == "cuda" and torch.equal(loaded, kept)  # no step since the save
