"""CheckpointManager: atomic saves, retention, async saves, loading in place."""

import time

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
    files = meta.pop("files")  # the manifest: every file's size and checksum
    assert meta == {"model": "x", "tokens_seen": 70, "step": 7}
    assert set(files) == {".metadata", "__0_0.distcp"}
    assert files["__0_0.distcp"]["bytes"] == (manager.latest() / "__0_0.distcp").stat().st_size
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


def _tied_stages(seed: int):
    """Both ends of a tied model's pipeline in one process (a V schedule's rank 0), each with
    its optimizer, after one step on equal gradients (as the step engine makes them)."""
    from forja.optim import OptimizerGroup
    from forja.optim.config import OptimConfig
    from forja.parallel.pp_split import stage_part

    meta = build_model("llama", "debug", device="meta", n_layers=2)
    parts = [stage_part(meta, s, [1, 1]) for s in (0, 1)]
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(seed)
    group = OptimizerGroup(parts, OptimConfig(lr=1e-2))
    for part in parts:
        for p in part.parameters():
            p.grad = torch.full_like(p, 0.5)
    group.step()
    return parts, group


def test_tied_copies_are_stored_once_and_load_as_two(tmp_path, process_group):
    import torch.distributed.checkpoint as dcp

    parts, group = _tied_stages(1)
    first, last = parts
    assert torch.equal(first.tok_embeddings.weight, last.output.weight)
    manager = CheckpointManager(CheckpointConfig(), tmp_path)
    manager.save(1, {"model": ModelState(parts), "optim": OptimizerState(parts, group.optimizers)})
    keys = dcp.FileSystemReader(str(manager.latest())).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and not any("output.weight" in k for k in keys)

    loaded, loaded_group = _tied_stages(2)
    manager.load(manager.latest(),
                 {"model": ModelState(loaded), "optim": OptimizerState(loaded, loaded_group.optimizers)})
    assert torch.equal(loaded[0].tok_embeddings.weight, first.tok_embeddings.weight)
    assert torch.equal(loaded[1].output.weight, first.tok_embeddings.weight)
    states = [opt.state[p] for opt, p in zip(loaded_group.optimizers, (loaded[0].tok_embeddings.weight,
                                                                       loaded[1].output.weight))]
    assert torch.equal(states[0]["exp_avg"], states[1]["exp_avg"])
    # Each optimizer owns its state: one shared tensor would be updated twice per step.
    assert states[0]["exp_avg"].data_ptr() != states[1]["exp_avg"].data_ptr()


def _snapshot(model, opt) -> tuple[dict, dict]:
    """Copies of the model's and the optimizer's tensors as they are now."""
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    return weights, moments


def test_async_save_is_a_snapshot_of_the_state_at_save_time(tmp_path, process_group):
    manager = CheckpointManager(CheckpointConfig(async_save=True), tmp_path)
    model, state = _state(1)
    opt = state["optim"].optimizers[0]
    weights, moments = _snapshot(model, opt)
    manager.save(1, state)
    # Training goes on at once, in place, while the write is in flight.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    assert not torch.equal(next(iter(model.state_dict().values())), next(iter(weights.values())))
    manager.wait()

    other, other_state = _state(2)
    manager.load(manager.latest(), other_state)
    for name, value in other.state_dict().items():
        assert torch.equal(value, weights[name]), name
    loaded = other_state["optim"].optimizers[0].state_dict()["state"]
    for i, saved in moments.items():
        for key, value in saved.items():
            assert torch.equal(loaded[i][key], value), (i, key)


def test_poll_finalizes_when_the_write_is_done(tmp_path, process_group):
    manager = CheckpointManager(CheckpointConfig(async_save=True), tmp_path)
    _, state = _state(1)
    assert manager.poll() is None  # nothing pending
    final = manager.save(3, state)
    assert manager.latest() is None  # only poll() or wait() finalizes, on the main thread
    deadline = time.monotonic() + 60
    while (path := manager.poll()) is None:
        assert time.monotonic() < deadline, "the async save never finished"
        time.sleep(0.01)
    assert path == final == manager.latest()
    assert manager.poll() is None and manager.wait() is None
    assert 0 < manager.last_blocking_s <= manager.last_total_s


def test_poll_without_a_pending_save_needs_no_process_group(tmp_path):
    manager = CheckpointManager(CheckpointConfig(async_save=True), tmp_path)
    assert manager.poll() is None and manager.wait() is None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, process_group, async_save):
    manager = CheckpointManager(CheckpointConfig(async_save=async_save), tmp_path)
    model, state = _state(1)
    manager.save(1, state)
    manager.wait()
    (tmp_path / "step-00000002.partial").write_text("")  # a file where the directory must go
    with pytest.raises(ForjaError, match=r"could not write checkpoint step-00000002 .*step-00000001 is intact"):
        manager.save(2, state)
        while manager.poll() is None:
            time.sleep(0.01)
    assert manager.latest() == tmp_path / "step-00000001"
    assert manager.poll() is None  # nothing left pending
    assert manager.last_total_s is not None
