"""A checkpoint's files checked against the sizes and checksums recorded when it was saved.

At save, each rank hashes the files it wrote itself (DCP names them `__<rank>_<n>.distcp`;
rank 0 also writes `.metadata`) once its own write is done, while they are still in the page
cache; rank 0 records every file's size and CRC-32 in forja.json under "files". At load, the
sizes are always compared (one stat per file); the checksums on a run's resume and on export,
the files shared out among the ranks. A checkpoint saved before the manifest existed is
checked for what it can be: its .metadata readable, every file it names there present and
long enough.

zlib.crc32 rather than a cryptographic hash: what is looked for is damage (a copy cut short,
a file overwritten), not an adversary. It runs at about 2.3 GB/s on one core and releases the
GIL, so a file gets one CRC per 32 MiB block and the blocks are hashed in parallel threads:
a rank's one large shard would otherwise be hashed by one core.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from forja.checkpoint import remote
from forja.checkpoint.remote import metadata_damage

MANIFEST_KEY = remote.MANIFEST_KEY
META_FILE = remote.META_FILE
_STEP_NAME = re.compile(r"step-(\d{8})")
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # a file DCP's FileSystemWriter wrote for that rank
BLOCK = 32 << 20  # bytes per CRC: the unit hashed in parallel
_READ = 8 << 20  # bytes read per call: large enough that crc32 runs at full speed, small in memory


def complete_checkpoints(folder: Path | str) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `folder` (renamed from .partial, with a
    forja.json), oldest first; in a store (a URL), (step, URL) of those with a forja.json."""
    if remote.is_remote(folder):
        return remote.complete_checkpoints(str(folder))
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _STEP_NAME.fullmatch(p.name)) and (p / META_FILE).is_file()]
    return sorted(found)


# -- at save ---------------------------------------------------------------------------------

def own_files(folder: Path, rank: int) -> list[str]:
    """The files of a checkpoint being written that `rank` hashes: those DCP wrote for it;
    rank 0 also every other one (.metadata)."""
    names = []
    for p in sorted(folder.iterdir()):
        if not p.is_file() or p.name == META_FILE or p.name.startswith(f".{META_FILE}"):
            continue
        m = _RANK_FILE.fullmatch(p.name)
        if (int(m.group(1)) if m else 0) == rank:
            names.append(p.name)
    return names


def _block_crc(path: Path, offset: int, length: int) -> str:
    """CRC-32 of `length` bytes of `path` from `offset`, as 8 hex digits."""
    crc, left = 0, length
    view = memoryview(bytearray(min(_READ, length)))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while left > 0 and (n := f.readinto(view[:min(left, len(view))])):
            crc = zlib.crc32(view[:n], crc)
            left -= n
    return f"{crc:08x}"


def digests(folder: Path, names: list[str], block: int = BLOCK) -> dict[str, dict]:
    """{"bytes": size, "block": block, "crc32": [one per block]} of each named file of `folder`;
    the blocks of all of them are hashed in parallel threads."""
    sizes = {name: (folder / name).stat().st_size for name in names}
    jobs = [(name, start, min(block, sizes[name] - start)) for name in names
            for start in range(0, max(sizes[name], 1), block)]  # an empty file: one empty block
    workers = min(len(jobs), os.cpu_count() or 1, 8)
    if workers <= 1:
        crcs = [_block_crc(folder / name, start, n) for name, start, n in jobs]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            crcs = list(pool.map(lambda job: _block_crc(folder / job[0], job[1], job[2]), jobs))
    found = {name: {"bytes": sizes[name], "block": block, "crc32": []} for name in names}
    for (name, _, _), crc in zip(jobs, crcs):
        found[name]["crc32"].append(crc)
    return found


# -- at load ---------------------------------------------------------------------------------

def damage(path: Path, *, checksums: bool, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the checkpoint at `path`, in a few words; None when nothing is.

    With `world` > 1 each rank checks its share of the files: call it on every rank and
    combine the answers with `agree`. A checkpoint in a store is checked by rank 0 (remote.py).
    """
    if remote.is_remote(path):
        return remote.damage(str(path), rank=rank)
    try:
        meta = json.loads((path / META_FILE).read_text())
    except OSError as exc:
        return f"its {META_FILE} cannot be read ({exc.strerror or exc})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"its {META_FILE} is not valid JSON: cut short or overwritten"
    files = meta.get(MANIFEST_KEY) if isinstance(meta, dict) else None
    if not isinstance(files, dict):  # saved before the manifest: what can be checked without it
        return _legacy_damage(path) if rank == 0 else None
    try:
        mine = sorted(files)[rank::world]
        for name in mine:
            if problem := _size_damage(path / name, files[name]["bytes"]):
                return problem
        if checksums:
            found: dict[str, dict] = {}
            for block in sorted({files[name]["block"] for name in mine}):
                found.update(digests(path, [n for n in mine if files[n]["block"] == block], block))
            for name in mine:
                bad = [i for i, (a, b) in enumerate(zip(found[name]["crc32"], files[name]["crc32"])) if a != b]
                if bad:
                    return (f"the bytes of {name} do not match its checksums (from byte "
                            f"{bad[0] * files[name]['block']:,} on)")
    except (KeyError, TypeError):
        return f"the file list in its {META_FILE} is malformed"
    # Without checksums an overwritten .metadata of the same size passes the sizes; with them, a
    # crafted one passes too (its checksums rewritten to match): read it, admitting only DCP's records.
    return metadata_damage(path)[0] if rank == 0 else None


def _size_damage(path: Path, expected: int, *, exact: bool = True) -> str | None:
    """`exact`: the size the manifest records; else the least size .metadata implies."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path.name} is missing"
    if size != expected if exact else size < expected:
        source = "its manifest says" if exact else "its .metadata needs at least"
        return f"{path.name} is {size:,} bytes, {source} {expected:,}"
    return None


def _legacy_damage(path: Path) -> str | None:
    """A checkpoint without a manifest: its .metadata readable, the files it names long enough."""
    problem, metadata = metadata_damage(path)
    if problem is not None:
        return problem
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        if problem := _size_damage(path / name, size, exact=False):
            return problem
    return None


def agree(problem: str | None) -> str | None:
    """Every rank's answer of `damage`, combined: the first problem found, the same on every rank."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return problem
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p), None)


@dataclass
class Pick:
    """The newest intact checkpoint of a folder (None if there is none) and the newer, damaged ones."""

    path: Path | None
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # (checkpoint, what is wrong), newest first

    def notice(self, verb: str) -> str:
        """One sentence: which checkpoints are damaged and which one is used instead."""
        (first, why), rest = self.damaged[0], self.damaged[1:]
        text = f"{first} is damaged ({why})" + "".join(f"; so is {remote.name_of(p)} ({w})" for p, w in rest)
        return f"{text}; {verb} {remote.name_of(self.path)}, the newest intact checkpoint"

    def none_intact(self, folder: Path) -> str:
        listed = "; ".join(f"{remote.name_of(p)}: {w}" for p, w in self.damaged)
        return f"no checkpoint in {folder} is intact ({listed})"


def newest_intact(folder: Path, *, checksums: bool, rank: int = 0, world: int = 1) -> Pick:
    """The newest checkpoint of `folder` that `damage` finds nothing wrong with. Collective
    when `world` > 1: rank 0's list of checkpoints is the one every rank walks."""
    candidates = complete_checkpoints(folder) if rank == 0 else []
    if world > 1:
        box = [candidates]
        dist.broadcast_object_list(box, src=0)
        candidates = box[0]
    pick = Pick(None)
    for _, path in reversed(candidates):
        problem = agree(damage(path, checksums=checksums, rank=rank, world=world))
        if problem is None:
            pick.path = path
            return pick
        pick.damaged.append((path, problem))
    return pick


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to `<name>.damaged`: no longer a checkpoint to load, out of the
    way of the one the run writes again at that step, and kept to be looked at."""
    if remote.is_remote(path):
        return remote.set_aside(str(path))
    aside = path.with_name(path.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)
    return aside
