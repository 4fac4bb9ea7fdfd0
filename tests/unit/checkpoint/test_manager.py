"""CheckpointManager: atomic saves, retention, async saves, loading in place."""

import pytest
import torch

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager, complete_checkpoints
from forja.checkpoint.states import ModelState, OptimizerState, TrainerCounters
from forja.errors import ForjaError
from forja.models import build_model
from forja.parallel.process_group import init_distributed, shutdown_distributed


@pytest.fixture
def process_group():
    init_distributed("cpu")
    yield
    shutdown_distributed()


def _state(seed: int):
    model = build_model("llama", "debug", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    counters = TrainerCounters(step=seed, tokens_seen=10 * seed)
    return model, {"model": ModelState(model), "optim": OptimizerState(model, opt), "trainer": counters}


@pytest.mark.parametrize("async_save", [False, True])
def test_save_then_load_restores_everything(tmp_path, process_group, async_save):
    manager = CheckpointManager(CheckpointConfig(async_save=async_save), tmp_path, meta={"model": "x"})
    model, state = _state(1)
    manager.save(7, state, {"tokens_seen": 70})
    manager.wait()
    assert manager.latest() == tmp_path / "step-00000007"
    other, other_state = _state(2)
    meta = manager.load(manager.latest(), other_state)
    assert meta == {"model": "x", "tokens_seen": 70, "step": 7}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert other_state["trainer"].step == 1
    exp_avg = other_state["optim"].optimizers[0].state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, state["optim"].optimizers[0].state_dict()["state"][0]["exp_avg"])


def test_keeps_the_last_n_and_ignores_partial(tmp_path, process_group):
    manager = CheckpointManager(CheckpointConfig(keep=2), tmp_path)
    _, state = _state(1)
    for step in (2, 4, 6):
        manager.save(step, state)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 6]
    (tmp_path / "step-00000008.partial").mkdir()  # what a crash mid-save leaves
    assert manager.latest() == tmp_path / "step-00000006"
    manager.clean_partial()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]


def test_check_refuses_before_reading(tmp_path, process_group):
    manager = CheckpointManager(CheckpointConfig(), tmp_path, meta={"model": "a"})
    _, state = _state(1)
    manager.save(1, state)

    def refuse(meta):
        raise ForjaError(f"holds {meta['model']}")

    with pytest.raises(ForjaError, match="holds a"):
        manager.load(manager.latest(), state, check=refuse)
