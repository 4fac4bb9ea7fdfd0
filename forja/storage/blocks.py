"""A bounded local cache of fixed-size blocks of remote objects, for reading shards by ranges.

A prepared shard on an object store is never downloaded whole: a read of bytes [lo, hi) fetches
the blocks it touches (FORJA_BLOCK_MB, default 8 MiB, one ranged GET each, retried) into
$FORJA_CACHE/blocks/ and serves the bytes from there. Once the blocks there pass the limit
(FORJA_CACHE_GB, default 20), the least recently used are deleted, whichever process wrote them,
so every rank and loader thread on a machine shares one bounded cache.

Each block file is named by its object's identity (URL, size and ETag or modification time) and
the block's index, so data prepared again under the same URL never reads stale blocks, and a
restarted run finds the blocks it read before. A block is written under a temporary name and
renamed, so a killed process never leaves a short block behind.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from forja.errors import ForjaError
from forja.storage.fs import env_number, filesystem, retrying

DEFAULT_BLOCK_MB = 8
DEFAULT_LIMIT_GB = 20.0
_TOUCH_EVERY_S = 10.0  # how often a block's recency is refreshed on disk (its mtime)
_RESCAN_EVERY = 32  # blocks written between scans of the directory (other processes write too)


def cache_root() -> Path:
    """forja's cache: $FORJA_CACHE, else ~/.cache/forja."""
    return Path(os.environ.get("FORJA_CACHE") or "~/.cache/forja").expanduser()


def object_key(url: str, info: dict[str, Any]) -> str:
    """The identity of object `url` as `info` (fsspec's info()) describes it: its content changes it."""
    version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
    return hashlib.sha256(f"{url}\0{info.get('size')}\0{version}".encode()).hexdigest()[:32]


class BlockCache:
    """Blocks of `block_size` bytes of remote objects kept in `directory`, at most `limit_bytes`."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, limit_bytes: int | None = None,
                 block_size: int | None = None):
        self.directory = Path(directory) if directory is not None else cache_root() / "blocks"
        gb = env_number("FORJA_CACHE_GB", DEFAULT_LIMIT_GB, least=0)
        self.limit = int(limit_bytes if limit_bytes is not None else gb * 2**30)
        mb = env_number("FORJA_BLOCK_MB", DEFAULT_BLOCK_MB, least=0)
        self.block_size = int(block_size if block_size is not None else mb * 2**20)
        if self.block_size < 1 or self.limit < self.block_size:
            raise ForjaError(f"the block cache (FORJA_CACHE_GB, {self.limit} bytes) cannot hold one block "
                             f"(FORJA_BLOCK_MB, {self.block_size} bytes); raise the first or lower the second")
        self.fetched = 0  # blocks fetched from the store by this process (tests, statistics)
        self._lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self._bytes: int | None = None  # what this process believes the directory holds
        self._written = 0

    def read(self, url: str, key: str, size: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of object `url` (`size` bytes, identity `key` from object_key)."""
        end = min(end, size)
        if end <= start:
            return b""
        parts = []
        first, last = start // self.block_size, (end - 1) // self.block_size
        for index in range(first, last + 1):
            base = index * self.block_size
            lo, hi = max(start, base) - base, min(end, base + self.block_size) - base
            parts.append(self._slice(url, key, size, index, lo, hi))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _slice(self, url: str, key: str, size: int, index: int, lo: int, hi: int) -> bytes:
        path = self.directory / f"{key}-{index:08d}"
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), hi - lo, lo)
            if len(data) == hi - lo:
                self._touch(path)
                return data
        except FileNotFoundError:
            pass
        block = self._fetch(url, size, index)
        self._store(path, block)
        return block[lo:hi]

    def _fetch(self, url: str, size: int, index: int) -> bytes:
        start = index * self.block_size
        end = min(size, start + self.block_size)
        fs, path = filesystem(url)
        data = retrying(lambda: fs.cat_file(path, start=start, end=end),
                        what=f"reading bytes {start}-{end} of {url}", url=url)
        if len(data) != end - start:  # the object changed under us: say which, not a shape error later
            raise OSError(f"{url} returned {len(data)} bytes for [{start}, {end}); it changed while being read")
        with self._lock:
            self.fetched += 1
        return data

    def _store(self, path: Path, block: bytes) -> None:
        """Keep `block` in the cache (best effort: a cache that cannot be written only costs reads)."""
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(block)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._touched[path.name] = time.monotonic()
            self._written += 1
            if self._bytes is None or self._written % _RESCAN_EVERY == 0:
                self._bytes = None
            else:
                self._bytes += len(block)
            over = self._bytes is None or self._bytes > self.limit
        if over:
            self.evict()

    def _touch(self, path: Path) -> None:
        now = time.monotonic()
        if now - self._touched.get(path.name, -_TOUCH_EVERY_S) < _TOUCH_EVERY_S:
            return
        self._touched[path.name] = now
        try:
            os.utime(path)
        except OSError:
            pass  # evicted by another process meanwhile: the next read fetches it again

    def evict(self) -> None:
        """Delete the least recently used blocks until the directory holds at most the limit."""
        with self._lock:
            entries = []
            try:
                with os.scandir(self.directory) as it:
                    for entry in it:
                        if entry.is_file() and not entry.name.startswith("."):
                            st = entry.stat()
                            entries.append((st.st_mtime, st.st_size, entry.path))
            except FileNotFoundError:
                pass
            total = sum(e[1] for e in entries)
            for _, nbytes, path in sorted(entries):
                if total <= self.limit:
                    break
                try:
                    os.unlink(path)
                    total -= nbytes
                except FileNotFoundError:
                    total -= nbytes
            self._bytes = total

    def usage(self) -> int:
        """Bytes of blocks in the directory now."""
        try:
            with os.scandir(self.directory) as it:
                return sum(e.stat().st_size for e in it if e.is_file() and not e.name.startswith("."))
        except FileNotFoundError:
            return 0


_default: BlockCache | None = None
_default_lock = threading.Lock()


def default_cache() -> BlockCache:
    """The process's block cache, built from the environment on first use."""
    global _default
    with _default_lock:
        settings = (os.environ.get("FORJA_CACHE"), os.environ.get("FORJA_CACHE_GB"), os.environ.get("FORJA_BLOCK_MB"))
        if _default is None or getattr(_default, "_settings", None) != settings:
            _default = BlockCache()
            _default._settings = settings  # type: ignore[attr-defined]
        return _default
