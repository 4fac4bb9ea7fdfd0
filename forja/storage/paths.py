"""Corpus files on an object store, used where the sources use a local Path.

`expand(pattern)` turns `s3://bucket/corpus/*.jsonl` (a glob), `s3://bucket/corpus/` (every
object below it, hidden names skipped) or one object's URL into sorted StoredPaths. A
StoredPath has the few Path methods the sources call (`read_bytes`, `open`, `stat`, `name`,
`suffix`), so a file source, `jsonl:` and `parquet:` read from a store as from a disk:
`open` streams the object (read ahead in blocks, never copied whole), `stat` gives its size
and a modification time for the cache keys of prepared data and tokenizers.

Streaming reads are retried by botocore itself (the filesystem is built with
`inner_attempts=ATTEMPTS`): a read in the middle of a file is one of many requests that forja
cannot wrap one by one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import IO, Any

from forja.errors import ForjaError
from forja.storage.fs import ATTEMPTS, check_reachable, filesystem, protocol, retrying


@dataclass(frozen=True)
class StoredStat:
    st_size: int
    st_mtime_ns: int


class StoredPath:
    """One object of a store, in place of a pathlib.Path for the sources."""

    def __init__(self, url: str, info: dict[str, Any] | None = None):
        self.url = url
        self._info = info

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"StoredPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: StoredPath) -> bool:
        return self.url < other.url

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rindex("."):] if "." in name.lstrip(".") else ""

    def info(self) -> dict[str, Any]:
        if self._info is None:
            fs, path = filesystem(self.url)
            self._info = retrying(lambda: fs.info(path), what=f"looking up {self.url}", url=self.url)
        return self._info

    def stat(self) -> StoredStat:
        """Its size, and a modification time that changes with its content (from the ETag when
        the store gives one: a store's times may not change on an overwrite within a second)."""
        info = self.info()
        version = str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime"))
        return StoredStat(int(info["size"]), int(hashlib.sha256(version.encode()).hexdigest()[:15], 16))

    def read_bytes(self) -> bytes:
        from forja.storage.fs import read_bytes

        return read_bytes(self.url)

    def open(self, mode: str = "rb") -> IO[Any]:
        if mode != "rb":
            raise ValueError("a stored corpus file is opened for reading bytes only")
        fs, path = filesystem(self.url, inner_attempts=ATTEMPTS)
        return retrying(lambda: fs.open(path, "rb"), what=f"opening {self.url}", url=self.url)


def expand(pattern: str, *, what: str) -> list[StoredPath]:
    """The objects a URL names: a glob, a "directory" (every non-hidden object below), or one."""
    check_reachable(pattern.split("*", 1)[0].split("?", 1)[0], write=False, what=what)
    fs, path = filesystem(pattern)
    scheme = protocol(pattern)
    magic = next((i for i, c in enumerate(path) if c in "*?["), None)
    if magic is not None:
        base = path[:magic].rsplit("/", 1)[0]
        found = retrying(lambda: fs.glob(path, detail=True), what=f"listing {pattern}", url=pattern)
    else:
        base = path.rstrip("/")
        found = retrying(lambda: fs.find(path, detail=True), what=f"listing {pattern}", url=pattern)
    files = [StoredPath(f"{scheme}://{name}", info) for name, info in sorted(found.items())
             if info.get("type", "file") == "file" and not _hidden(name[len(base):])]
    if not files:
        raise ForjaError(f"{what} {pattern!r} matches no object; check the URL (a glob, a prefix or an object)")
    return files


def _hidden(relative: str) -> bool:
    """Whether a name below the pattern's base has a hidden part (".git/", ".tmp"), skipped as on disk."""
    return any(part.startswith(".") for part in relative.split("/") if part)
