"""A hang becomes an error: a rank that stops answering makes the others fail within
about `parallel.timeout_s`, in every process group forja uses, rather than wait torch's
default of 30 minutes (Gloo) or 10 (NCCL). (Through the trainer the watchdog reports a hang
first: tests/distributed/test_drills.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims
from forja.parallel.process_group import init_distributed
from forja.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0


def _wait_in_each_group(rank: int, world_size: int, flag: str) -> dict[str, float] | None:
    """Rank 0 enters a collective alone in each group the trainer may use; the others stay
    alive without joining (a rank that exits would close the connections, an error that
    comes at once and would hide a missing timeout). Returns how long each one took to fail."""
    init_distributed("cpu", timeout_s=2.0)  # as the trainer does, inside run_distributed's group
    dims = ParallelDims.from_config(ParallelConfig(pp=2, dp_replicate=2), world_size)
    mesh = dims.build_mesh("cpu")
    groups = {"mesh pp": mesh["pp"].get_group(), "mesh dp_replicate": mesh["dp_replicate"].get_group(),
              "pipeline ends (tied embedding)": dims.pp_ends_group, "cpu (stop flags)": dims.cpu_group}
    if rank != 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    waited = {}
    try:
        for name, group in groups.items():
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
            except RuntimeError as exc:
                assert "timed out" in str(exc).lower(), f"{name}: {exc}"
            waited[name] = time.monotonic() - start
    finally:
        Path(flag).touch()
    return waited


def test_every_group_gets_the_timeout(tmp_path):
    """parallel.timeout_s reaches the mesh's sub-groups and forja's own Gloo group, which
    torch would otherwise create with its 30-minute default. (4 ranks: with 2, every mesh
    dimension of size 2 is the world group itself.) run_distributed's world group has a
    long timeout, so only the groups made after init_distributed are under test."""
    waited = run_distributed(_wait_in_each_group, 4, str(tmp_path / "done"), timeout_s=60)[0]
    print(", ".join(f"{name}: {s:.1f} s" for name, s in waited.items()))
    for name, seconds in waited.items():
        assert 1.5 < seconds < 15, f"{name}: {seconds:.1f} s"
