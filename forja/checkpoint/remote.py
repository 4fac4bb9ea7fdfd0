"""Checkpoints in an object store (a run.dir such as `s3://bucket/runs/x`).

    <run.dir>/checkpoints/step-00000100/   DCP's objects, then forja.json: complete
    <run.dir>/checkpoints/step-00000200/   no forja.json: being written, or left by a crash

A store such as S3 has no rename, so a checkpoint cannot be written under a temporary name and
renamed when complete, as on a disk (manager.py). Instead it is written under its own name
and forja.json, the manifest, is written last, by rank 0, once every rank's objects and DCP's
.metadata are in place: a checkpoint without its forja.json is partial, never loaded, and
removed at the next start. Retention and setting aside delete forja.json first, so a deletion
cut short leaves a partial checkpoint, never a complete-looking one with objects missing.

DCP writes and reads the objects through its fsspec storage (FsspecWriter / FsspecReader),
with the filesystem options of forja.storage and the client's own per-request retries, since
forja cannot wrap DCP's requests in its own `retrying`. Every other request here (listing,
the manifest, deletions) goes through `retrying`.

The manifest records each object's size (from one listing by rank 0 after DCP's save), not
CRC-32s: reading every object back to hash it would double a save's traffic, and a store
object is written whole or not at all, its upload checksummed by the client. Damage here
means objects missing or of the wrong size (a deletion or an overwrite from elsewhere), and
.metadata that does not unpickle.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from forja import storage

_STEP_NAME = re.compile(r"step-(\d{8})")
META_FILE = "forja.json"  # the manifest (verify.py), the commit marker here
MANIFEST_KEY = "files"


def is_remote(path: str | os.PathLike[str]) -> bool:
    return storage.is_url(path)


def name_of(path: str | os.PathLike[str]) -> str:
    """The last component of a path or URL ("step-00000100")."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _options(url: str) -> dict[str, Any]:
    return storage.storage_options(url, inner_attempts=storage.ATTEMPTS)


def reader(path: str | os.PathLike[str]):
    """DCP's storage reader for a checkpoint on disk or in a store, reading only what forja
    trusts (trust.py): every checkpoint forja reads goes through here."""
    from forja.checkpoint import trust

    if not is_remote(path):
        return trust.TrustedFileSystemReader(str(path))
    return trust.fsspec_reader(str(path), **_options(str(path)))


def dcp_target(path: str | os.PathLike[str], *, write: bool) -> dict[str, Any]:
    """The keyword arguments of dcp.save / dcp.load / dcp.async_save for `path`: its
    checkpoint_id on disk (DCP picks its file system storage), an fsspec storage in a store.
    (A store's storage is not given a checkpoint_id as well: DCP would rebuild its filesystem
    from the id alone, without forja's options.) A load reads only what forja trusts (trust.py)."""
    if not write:
        from forja.checkpoint.trust import TrustedLoadPlanner

        return {"storage_reader": reader(path), "planner": TrustedLoadPlanner(str(path))}
    if not is_remote(path):
        return {"checkpoint_id": str(path)}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # torch 2.11 and 2.13

    # sync_files: an fsync of a store's stream falls back to a machine-wide os.sync(); an
    # object is durable once its upload returns anyway.
    return {"storage_writer": FsspecWriter(str(path), sync_files=False, **_options(str(path)))}


def _fs(url: str) -> tuple[Any, str]:
    fs, path = storage.filesystem(url)
    fs.invalidate_cache(path)  # DCP wrote through another client: never trust a cached listing
    return fs, path


def _listing(url: str, *, what: str) -> list[dict]:
    """The entries right under `url` (dicts with name, size, type); none when it does not exist."""
    fs, path = _fs(url)
    try:
        return storage.retrying(lambda: fs.ls(path, detail=True, refresh=True), what=what, url=url)
    except FileNotFoundError:
        return []


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, URL) of every complete checkpoint in the store folder `folder`, oldest first."""
    found = []
    for step, url in _step_dirs(folder):
        if storage.exists(storage.join(url, META_FILE)):
            found.append((step, url))
    return sorted(found)


def _step_dirs(folder: str) -> list[tuple[int, str]]:
    out = []
    for entry in _listing(folder, what=f"listing checkpoints in {folder}"):
        name = name_of(entry["name"])
        if entry.get("type") == "directory" and (m := _STEP_NAME.fullmatch(name)):
            out.append((int(m.group(1)), storage.join(folder, name)))
    return sorted(out)


def read_text(url: str) -> str:
    return storage.read_bytes(url).decode("utf-8")


def sizes(url: str, rank: int) -> dict[str, dict]:
    """The manifest entries ({"bytes": size}) of a checkpoint DCP has just written at `url`:
    every object but forja.json, listed by rank 0 (DCP's save returns on rank 0 only once every
    rank's write is done and .metadata written); {} on other ranks."""
    if rank != 0:
        return {}
    return {name_of(e["name"]): {"bytes": int(e["size"])}
            for e in sorted(_listing(url, what=f"listing {url}"), key=lambda e: e["name"])
            if e.get("type") == "file" and name_of(e["name"]) != META_FILE}


def commit(url: str, meta: dict) -> None:
    """Write the manifest, forja.json, last: the checkpoint at `url` is complete from now on."""
    storage.commit(url, META_FILE, json.dumps(meta, indent=2))


def remove(url: str) -> None:
    """Delete the checkpoint at `url`, its manifest first (see the module docstring)."""
    fs, path = _fs(url)
    marker = f"{path}/{META_FILE}"
    try:
        storage.retrying(lambda: fs.rm_file(marker), what=f"deleting {url}/{META_FILE}", url=url)
    except FileNotFoundError:
        pass
    storage.remove_tree(url)


def clean_partial(folder: str) -> None:
    """Remove the checkpoints of `folder` that have no forja.json (left by a crash)."""
    for _, url in _step_dirs(folder):
        if not storage.exists(storage.join(url, META_FILE)):
            storage.remove_tree(url)


def set_aside(url: str) -> str:
    """Copy a damaged checkpoint to `<name>.damaged` and delete it (a store has no rename)."""
    aside = url.rstrip("/") + ".damaged"
    storage.remove_tree(aside)
    fs, path = _fs(url)
    _, aside_path = storage.filesystem(aside)
    storage.retrying(lambda: fs.copy(path, aside_path, recursive=True), what=f"copying {url} aside", url=url)
    remove(url)
    return aside


def damage(url: str, *, rank: int = 0) -> str | None:
    """What is wrong with the store checkpoint at `url` (rank 0 checks; None elsewhere)."""
    if rank != 0:
        return None
    try:
        meta = json.loads(read_text(storage.join(url, META_FILE)))
    except FileNotFoundError:
        return f"its {META_FILE} is missing"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"its {META_FILE} is not valid JSON: cut short or overwritten"
    files = meta.get(MANIFEST_KEY) if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return f"its {META_FILE} has no file list"
    listed = {name_of(e["name"]): int(e["size"]) for e in _listing(url, what=f"listing {url}")
              if e.get("type") == "file"}
    try:
        for name in sorted(files):
            if name not in listed:
                return f"{name} is missing"
            if listed[name] != files[name]["bytes"]:
                return f"{name} is {listed[name]:,} bytes, its manifest says {files[name]['bytes']:,}"
    except (KeyError, TypeError):
        return f"the file list in its {META_FILE} is malformed"
    return metadata_damage(url)[0]


def metadata_damage(path: str | os.PathLike[str]):
    """(what is wrong with DCP's .metadata of a checkpoint, on disk or in a store, or None;
    the Metadata when it reads)."""
    from forja.checkpoint.trust import UntrustedCheckpoint

    try:
        metadata = reader(path).read_metadata()
    except FileNotFoundError:
        return ".metadata is missing", None
    except UntrustedCheckpoint as exc:
        return f"its .metadata {exc.reason}", None
    except Exception as exc:  # unpickling garbage raises any kind of error (EOF, KeyError, ...)
        return f"its .metadata cannot be read ({type(exc).__name__}): cut short or overwritten", None
    return None, metadata  # the trusted reader returns DCP's Metadata or raises


def run_of(checkpoint: str) -> str:
    """The run directory of a store checkpoint (<run>/checkpoints/step-N)."""
    return checkpoint.rstrip("/").rsplit("/", 2)[0]


def local_copy(url: str, folder: Path) -> Path:
    """Download the object `url` into `folder` under its own name (with retries)."""
    target = folder / name_of(url)
    target.write_bytes(storage.read_bytes(url))
    return target
