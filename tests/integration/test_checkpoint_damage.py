"""Drills: a damaged checkpoint (a .distcp file cut short, .metadata overwritten, forja.json cut)
is named in one sentence by `forja train`, `generate`, `export` and `eval`; a run directory's
newest intact checkpoint is used instead, and a damaged checkpoint given by name stops with
exit code 2. A crafted checkpoint (its checksums rewritten to match) is refused before anything
in it is unpickled. One short run is trained; each test damages a copy of it."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from forja.cli import main

from .conftest import read_metrics, train_args

CHANGES = {"train.steps": "4", "checkpoint.interval": "2", "train.val_interval": "0", "train.sample_tokens": "0"}
NEWEST, PREVIOUS = "step-00000004", "step-00000002"


def cut_shard(ckpt: Path) -> str:
    shard = ckpt / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 3])
    return f"__0_0.distcp is {size // 3:,} bytes, its manifest says {size:,}"


def overwrite_metadata(ckpt: Path) -> str:
    metadata = ckpt / ".metadata"
    metadata.write_bytes(b"\0" * metadata.stat().st_size)  # the size is right, the bytes are not
    return ".metadata"


def cut_meta(ckpt: Path) -> str:
    meta = ckpt / "forja.json"
    meta.write_text(meta.read_text()[:60])
    return "its forja.json is not valid JSON: cut short or overwritten"


DAMAGE = {"cut .distcp": cut_shard, "overwritten .metadata": overwrite_metadata, "cut forja.json": cut_meta}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_data) -> Path:
    run = tmp_path_factory.mktemp("damage") / "run"
    assert main(train_args(run, train_data, **CHANGES)) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [PREVIOUS, NEWEST]
    return run


def damaged_copy(trained: Path, dest: Path, kind: str, *names: str) -> tuple[Path, str]:
    run = dest / "run"
    shutil.copytree(trained, run)
    why = ""
    for name in names:
        why = DAMAGE[kind](run / "checkpoints" / name)
    return run, why


@pytest.fixture(scope="module", params=list(DAMAGE))
def damaged_run(request, trained, tmp_path_factory) -> tuple[Path, str]:
    """A copy of the run whose newest checkpoint has one kind of damage (shared: read only)."""
    return damaged_copy(trained, tmp_path_factory.mktemp("damaged"), request.param, NEWEST)


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_train_resumes_from_the_newest_intact_checkpoint(trained, train_data, tmp_path, capsys, kind):
    run, why = damaged_copy(trained, tmp_path, kind, NEWEST)
    assert main(train_args(run, train_data, **CHANGES)) == 0
    out, err = capsys.readouterr()
    line = one_line(err)
    assert f"{run / 'checkpoints' / NEWEST} is damaged (" in line and why in line
    assert f"resuming from {PREVIOUS}, the newest intact checkpoint" in line
    assert f"resumed from {run / 'checkpoints' / PREVIOUS} (step 2)" in out
    # Steps 3 and 4 ran again and wrote step 4 anew; the damaged files are kept aside.
    assert [r["step"] for r in read_metrics(run) if "loss" in r][-2:] == [3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [PREVIOUS, NEWEST, f"{NEWEST}.damaged"]
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0  # the new step 4 is intact


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_train_stops_when_no_checkpoint_is_intact(trained, train_data, tmp_path, capsys, kind):
    run, why = damaged_copy(trained, tmp_path, kind, NEWEST, PREVIOUS)
    assert main(train_args(run, train_data, **CHANGES)) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"forja train: error: no checkpoint in {run / 'checkpoints'} is intact ")
    assert f"{NEWEST}: " in line and f"{PREVIOUS}: " in line and why in line
    assert "--start-over" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [PREVIOUS, NEWEST]  # nothing moved


COMMANDS = {
    "generate": lambda src, out: ["generate", str(src), "--prompt", "def", "--max-new-tokens", "2"],
    "export": lambda src, out: ["export", str(src), "--hf", str(out), "--overwrite"],
    "eval": lambda src, out: ["eval", str(src), "--task", "python_mc", "--limit", "2", "--json"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_run_directory_uses_its_newest_intact_checkpoint(damaged_run, tmp_path, capsys, command):
    run, why = damaged_run
    assert main(COMMANDS[command](run, tmp_path / "hf")) == 0
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"forja: {run / 'checkpoints' / NEWEST} is damaged (") and why in line
    assert line.endswith(f"; using {PREVIOUS}, the newest intact checkpoint")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_checkpoint_given_by_name_stops(damaged_run, tmp_path, capsys, command):
    run, why = damaged_run
    ckpt = run / "checkpoints" / NEWEST
    assert main(COMMANDS[command](ckpt, tmp_path / "hf")) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"forja {command}: error: {ckpt} is damaged (") and why in line
    assert not (tmp_path / "hf").exists()


# -- a checkpoint from elsewhere: checksums that match prove integrity, not origin --------------

class _Payload:
    """Unpickled, it would create `marker`: what a crafted checkpoint could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _rehash(ckpt: Path) -> None:
    """forja.json's sizes and checksums rewritten to match the files, as a crafter would."""
    from forja.checkpoint.verify import digests

    meta = json.loads((ckpt / "forja.json").read_text())
    meta["files"] = digests(ckpt, sorted(meta["files"]))
    (ckpt / "forja.json").write_text(json.dumps(meta))


def craft_metadata(ckpt: Path, marker: Path) -> None:
    """.metadata replaced by a pickle that opens a file."""
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rehash(ckpt)


def craft_value(ckpt: Path, marker: Path, key: str = "trainer.step") -> None:
    """One non-tensor value replaced by a torch.save blob that opens a file; .metadata (genuine
    records) pointed at it."""
    from forja.checkpoint.trust import read_metadata

    metadata = read_metadata((ckpt / ".metadata").read_bytes(), "test")
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    info.offset, info.length = offset, len(blob.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(ckpt)


def test_a_crafted_metadata_is_refused_naming_what_it_calls(trained, train_data, tmp_path, capsys):
    run, _ = damaged_copy(trained, tmp_path, "cut forja.json")  # a copy, undamaged (no names given)
    marker = tmp_path / "ran"
    craft_metadata(run / "checkpoints" / NEWEST, marker)
    ckpt = run / "checkpoints" / NEWEST
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 2  # checksums checked, and match
    line = one_line(capsys.readouterr().err)
    assert f"{ckpt} is damaged (its .metadata names io.open, which a forja checkpoint never holds" in line
    assert not marker.exists() and not (tmp_path / "hf").exists()
    # A resume passes over it as over any damage, names it, and keeps it aside.
    assert main(train_args(run, train_data, **CHANGES)) == 0
    line = one_line(capsys.readouterr().err)
    assert "names io.open" in line and f"resuming from {PREVIOUS}" in line
    assert not marker.exists()


def test_a_crafted_value_stops_the_load_naming_it(trained, train_data, tmp_path, capsys):
    run, _ = damaged_copy(trained, tmp_path, "cut forja.json")
    marker = tmp_path / "ran"
    craft_value(run / "checkpoints" / NEWEST, marker)
    assert main(train_args(run, train_data, **{**CHANGES, "train.steps": "6"})) == 2  # resumes: loads it
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"forja train: error: {run / 'checkpoints' / NEWEST}: its value trainer.step is not "
                           "plain data (it names io.open)")
    assert "forja does not load it" in line
    assert not marker.exists()
