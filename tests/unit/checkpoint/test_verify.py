"""Checkpoints that verify themselves: the manifest written at save (sync, async, two ranks),
each kind of damage found, the newest intact checkpoint chosen alike on every rank, and
checkpoints from before the manifest still loading."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager
from forja.checkpoint.verify import damage, digests, newest_intact
from forja.errors import ForjaError
from forja.parallel.process_group import init_distributed, shutdown_distributed
from forja.testing import run_distributed


@pytest.fixture
def process_group():
    init_distributed("cpu")
    yield
    shutdown_distributed()


def _state(value: float) -> dict:
    return {"weights": {"a": torch.full((1000,), value), "b": torch.arange(300.0) * value}}


def _saved(folder: Path, steps=(2, 4), async_save: bool = False) -> CheckpointManager:
    manager = CheckpointManager(CheckpointConfig(async_save=async_save, keep=0), folder)
    for step in steps:
        manager.save(step, _state(float(step)))
    manager.wait()
    return manager


@pytest.mark.parametrize("async_save", [False, True])
def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path, process_group, async_save):
    path = _saved(tmp_path, steps=(3,), async_save=async_save).latest()
    files = json.loads((path / "forja.json").read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "forja.json")
    assert sorted(files) == on_disk == [".metadata", "__0_0.distcp"]
    assert files == digests(path, on_disk)
    for name in on_disk:
        assert files[name]["bytes"] == (path / name).stat().st_size > 0
    assert damage(path, checksums=True) is None


def test_each_kind_of_damage_is_named(tmp_path, process_group):
    path = _saved(tmp_path, steps=(2,)).latest()
    shard = path / "__0_0.distcp"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:1234])
    assert damage(path, checksums=False) == f"__0_0.distcp is 1,234 bytes, its manifest says {len(whole):,}"
    # The same size, other bytes: only the checksum sees it.
    shard.write_bytes(whole[:100] + bytes(1 - b for b in whole[100:101]) + whole[101:])
    assert damage(path, checksums=False) is None
    assert damage(path, checksums=True) == "the bytes of __0_0.distcp do not match its checksums (from byte 0 on)"
    shard.write_bytes(whole)
    metadata = path / ".metadata"
    metadata.write_bytes(b"\0" * metadata.stat().st_size)  # overwritten in place: the sizes agree
    assert damage(path, checksums=True).startswith("the bytes of .metadata do not match its checksums")
    assert damage(path, checksums=False) == "its .metadata cannot be read (UnpicklingError): cut short or overwritten"
    meta = path / "forja.json"
    meta.write_text(meta.read_text()[:40])
    assert damage(path, checksums=False) == "its forja.json is not valid JSON: cut short or overwritten"


def test_resume_point_sets_damaged_checkpoints_aside(tmp_path, process_group, capsys):
    manager = _saved(tmp_path, steps=(2, 4, 6))
    for step in (4, 6):
        shard = tmp_path / f"step-0000000{step}" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:10])
    assert manager.resume_point() == tmp_path / "step-00000002"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}/step-00000006 is damaged (__0_0.distcp is 10 bytes" in err
    assert "so is step-00000004" in err and "resuming from step-00000002, the newest intact checkpoint" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004.damaged",
                                                          "step-00000006.damaged"]
    manager.save(4, _state(4.0))  # the step is written again where the damaged one was
    assert manager.latest() == tmp_path / "step-00000004" and manager.resume_point() == manager.latest()


def test_resume_point_stops_when_nothing_is_intact(tmp_path, process_group):
    manager = _saved(tmp_path, steps=(2,))
    (tmp_path / "step-00000002" / "forja.json").write_text("{")
    with pytest.raises(ForjaError, match=r"no checkpoint in .* is intact \(step-00000002: its forja.json is not "
                                         r"valid JSON.*--start-over"):
        manager.resume_point()


def test_a_checkpoint_from_before_the_manifest_still_loads(tmp_path, process_group):
    path = _saved(tmp_path, steps=(2,)).latest()
    meta = json.loads((path / "forja.json").read_text())
    del meta["files"]
    (path / "forja.json").write_text(json.dumps(meta))
    assert damage(path, checksums=True) is None
    manager = CheckpointManager(CheckpointConfig(), tmp_path)
    assert manager.resume_point() == path
    state = _state(0.0)
    manager.load(path, state)
    assert torch.equal(state["weights"]["b"], torch.arange(300.0) * 2)
    # What can be checked without a manifest still is: a file shorter than .metadata says.
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:50])
    assert damage(path, checksums=False).startswith("__0_0.distcp is 50 bytes, its .metadata needs at least")


def _two_ranks(rank: int, world_size: int, folder: str) -> tuple:
    folder = Path(folder)
    manager = CheckpointManager(CheckpointConfig(async_save=True, keep=0), folder, rank=rank)
    for step in (2, 4):
        manager.save(step, {"weights": {f"w{rank}": torch.full((500,), float(step + rank))}})
    manager.wait()
    files = sorted(json.loads((folder / "step-00000004" / "forja.json").read_text())["files"])
    torch.distributed.barrier()
    if rank == 1:  # damage a file only rank 1 checks (rank r takes every world_size-th file)
        shard = folder / "step-00000004" / files[1]
        shard.write_bytes(b"x" * shard.stat().st_size)
    torch.distributed.barrier()
    pick = newest_intact(folder, checksums=True, rank=rank, world=world_size)
    return files, pick.path.name, [(p.name, why) for p, why in pick.damaged]


def test_two_ranks_agree_on_the_checkpoint_to_load(tmp_path):
    results = run_distributed(_two_ranks, 2, str(tmp_path))
    assert results[0] == results[1]  # the same choice, found by rank 1 alone
    files, chosen, damaged = results[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks' shards, gathered
    assert chosen == "step-00000002"
    assert [name for name, _ in damaged] == ["step-00000004"]
    assert damaged[0][1] == f"the bytes of {files[1]} do not match its checksums (from byte 0 on)"


def test_a_file_is_hashed_block_by_block(tmp_path, process_group):
    path = _saved(tmp_path, steps=(2,)).latest()
    shard = path / "__0_0.distcp"
    data = shard.read_bytes()
    found = digests(path, [shard.name], block=1000)[shard.name]
    assert found["crc32"] == [f"{zlib.crc32(data[i:i + 1000]):08x}" for i in range(0, len(data), 1000)]
    assert len(found["crc32"]) == -(-len(data) // 1000) > 4
    meta = json.loads((path / "forja.json").read_text())  # a manifest of 1000-byte blocks: the damage is placed
    meta["files"] = digests(path, [".metadata", shard.name], block=1000)
    (path / "forja.json").write_text(json.dumps(meta))
    shard.write_bytes(data[:2500] + bytes([data[2500] ^ 1]) + data[2501:])
    assert damage(path, checksums=True) == "the bytes of __0_0.distcp do not match its checksums (from byte 2,000 on)"
