"""Async checkpoints under the conditions they exist for: a process killed while the write
is in flight leaves the previous checkpoint as the one to resume from, and two ranks keep
running collectives on the default group while DCP's background thread runs its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager
from forja.parallel.process_group import init_distributed, shutdown_distributed
from forja.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]

# Saves step 1 completely, then starts an async save of step 2 (32 MB) and is killed (-9)
# the moment save() returns: the write is still in flight, nothing is finalized.
KILLED_SAVER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    from forja.checkpoint.config import CheckpointConfig
    from forja.checkpoint.manager import CheckpointManager
    from forja.parallel.process_group import init_distributed

    init_distributed("cpu")
    manager = CheckpointManager(CheckpointConfig(async_save=True), Path(sys.argv[1]))
    state = {"weights": {f"w{i}": torch.full((1_000_000,), 1.0) for i in range(8)}}
    manager.save(1, state)
    manager.wait()
    for w in state["weights"].values():
        w.fill_(2.0)
    manager.save(2, state)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_kill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVER, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

    init_distributed("cpu")  # as the trainer that resumes would
    try:
        _resume_from_step_1(tmp_path)
    finally:
        shutdown_distributed()


def _resume_from_step_1(folder: Path) -> None:
    manager = CheckpointManager(CheckpointConfig(async_save=True), folder)
    assert manager.latest() == folder / "step-00000001"
    assert not (folder / "step-00000002").exists()
    manager.clean_partial()
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000001"]
    state = {"weights": {f"w{i}": torch.zeros(1_000_000) for i in range(8)}}
    manager.load(manager.latest(), state)
    assert all(torch.equal(w, torch.ones(1_000_000)) for w in state["weights"].values())


def _save_while_training(rank: int, world_size: int, folder: Path) -> int:
    init_distributed("cpu", timeout_s=30)
    manager = CheckpointManager(CheckpointConfig(async_save=True), folder, rank=rank)
    torch.manual_seed(rank)
    state = {f"rank{rank}": {f"w{i}": torch.randn(1_000_000) for i in range(8)}}  # 32 MB a rank
    saved = {k: v.clone() for k, v in state[f"rank{rank}"].items()}
    final = manager.save(5, state)
    steps, deadline = 0, time.monotonic() + 60
    while (path := manager.poll()) is None:
        # A training step's collectives on the default group, and in-place updates.
        x = torch.full((1024,), float(rank + 1))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((1024,), float(sum(range(1, world_size + 1)))))
        for w in state[f"rank{rank}"].values():
            w.mul_(0.5)
        steps += 1
        assert time.monotonic() < deadline, "the async save never finished"
    assert path == final == manager.latest()
    fresh = {f"rank{rank}": {k: torch.zeros_like(v) for k, v in saved.items()}}
    manager.load(path, fresh)
    for k, v in saved.items():
        assert torch.equal(fresh[f"rank{rank}"][k], v), k
    return steps


def test_two_ranks_train_while_an_async_save_is_in_flight(tmp_path):
    results = run_distributed(_save_while_training, 2, tmp_path, timeout_s=60)
    # Every rank finalized at the same poll: they agreed, and none ran ahead.
    assert results[0] == results[1], results
