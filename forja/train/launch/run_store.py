"""A run directory in an object store (run.dir = "s3://bucket/runs/x"), through a local mirror.

The run works in a local mirror, $FORJA_CACHE/runs/<name>-<hash of the URL>, as in any run
directory: the small files that are rewritten often (the hang watchdog's reports, goodput,
metrics appended line by line) are written on a disk, where a rename is atomic and a write
costs nothing. The store holds what the run is:

    <run.dir>/checkpoints/...   written there directly by DCP (forja/checkpoint/remote.py)
    <run.dir>/<file>            each top-level file of the mirror (config.toml, run.json,
                                tokenizer.json, metrics.jsonl, goodput.json, samples...)

Rank 0 uploads the mirror's top-level files that changed, each whole as one object (a PUT is
seen whole or not at all) with retries: at the start of a launch, after each checkpoint, at
most every SYNC_S seconds while metrics are logged, and at the end, a failed run's too.
Folders of the mirror (hang/, profile/, tensorboard/, wandb/...) stay on this machine.

At the start of each launch the store is the truth: rank 0 replaces the mirror's top-level
files with the store's, so a run resumed on another machine continues the store's
metrics.jsonl and run.json (a mirror's metrics written after the last upload are lines
beyond the checkpoint, which a resume drops anyway).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from pathlib import Path

from forja import storage
from forja.files import write_atomic

SYNC_S = 30.0
"""Seconds between two uploads while training logs (checkpoints and the end always upload)."""


def mirror_of(url: str) -> Path:
    """The local working copy of the run at `url` (the same path on every machine)."""
    from forja.data.corpus.prepare import cache_root

    url = url.rstrip("/")
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return cache_root() / "runs" / f"{url.rsplit('/', 1)[-1]}-{digest}"


class RunStore:
    """The store side of a run directory whose run.dir is `url`; `mirror` is its local copy."""

    def __init__(self, url: str, mirror: Path, *, rank: int = 0):
        self.url = url.rstrip("/")
        self.mirror = mirror
        self.rank = rank
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) as last uploaded or pulled
        self._last_sync = 0.0

    def url_of(self, name: str) -> str:
        return storage.join(self.url, name)

    def read(self, name: str) -> str | None:
        """The text of the store's top-level file `name`, None when there is none."""
        try:
            return storage.read_bytes(self.url_of(name)).decode("utf-8")
        except FileNotFoundError:
            return None

    def has_run(self) -> bool:
        return storage.exists(self.url_of("config.toml"))

    def _files(self) -> dict[str, int]:
        """The store's top-level files (name -> size); none when the run is new."""
        fs, path = storage.filesystem(self.url)
        fs.invalidate_cache(path)
        try:
            entries = storage.retrying(lambda: fs.ls(path, detail=True, refresh=True), what=f"listing {self.url}",
                                       url=self.url)
        except FileNotFoundError:
            return {}
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in entries if e.get("type") == "file"}
        return {n: size for n, size in names.items() if not n.startswith(".")}  # a write probe is not the run's

    def wipe(self) -> None:
        """Delete the run from the store and the mirror (run.start_over; rank 0)."""
        storage.remove_tree(self.url)
        shutil.rmtree(self.mirror, ignore_errors=True)

    def pull(self) -> None:
        """Make the mirror's top-level files the store's (rank 0, at the start of a launch)."""
        self.mirror.mkdir(parents=True, exist_ok=True)
        remote = self._files()
        for local in self._local_files():
            if local.name not in remote:
                local.unlink()
        for name in sorted(remote):
            write_atomic(self.mirror / name, storage.read_bytes(self.url_of(name)))
        self._sent = {p.name: _stamp(p) for p in self._local_files()}

    def sync(self, *, every_s: float = 0.0) -> None:
        """Upload the mirror's top-level files changed since the last upload (rank 0); with
        `every_s`, only when that long has passed since the last one."""
        if self.rank != 0 or (every_s and time.monotonic() - self._last_sync < every_s):
            return
        self._last_sync = time.monotonic()
        for path in self._local_files():
            stamp = _stamp(path)
            if self._sent.get(path.name) != stamp:
                storage.write_bytes_atomic(self.url_of(path.name), path.read_bytes())
                self._sent[path.name] = stamp

    def final_sync(self) -> None:
        """The end of a launch, a failed one too: upload what changed, or say in one line why not."""
        try:
            self.sync()
        except Exception as exc:  # noqa: BLE001 -- the run's own error, if any, is the one to raise
            if self.rank == 0:
                print(f"forja: warning: could not upload {self.mirror} to {self.url} ({exc}); "
                      "its files stay in that local copy", file=sys.stderr, flush=True)

    def _local_files(self) -> list[Path]:
        if not self.mirror.is_dir():
            return []
        # Hidden names are temporary files and write probes, never the run's.
        return sorted(p for p in self.mirror.iterdir() if p.is_file() and not p.name.startswith("."))


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
