"""What every document source is made of: the `Source` interface, the counts it keeps, and
the helpers that turn paths into files and bytes into clean text.

This module imports no source format, so each format (files and stdlib in sources.py,
JSONL, Parquet and Hugging Face datasets in records.py) builds on it and the imports run
one way: sources.py -> records.py -> source_base.py.
"""

from __future__ import annotations

import abc
import glob
import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from forja.errors import ForjaError
from forja.storage import is_url

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class SourceStats:
    """What reading a source counted besides the documents it yielded."""

    documents: int = 0
    """Documents yielded."""
    characters: int = 0
    """Characters in the documents yielded."""
    skipped_binary: int = 0
    """Files skipped because they look binary (a NUL byte near the start)."""
    replaced_utf8: int = 0
    """Documents whose invalid UTF-8 was replaced by U+FFFD."""
    skipped_bad_lines: int = 0
    """Bad records (JSON errors, missing or non-text fields) skipped on request."""

    def count(self, text: str) -> str:
        self.documents += 1
        self.characters += len(text)
        return text


class Source(abc.ABC):
    """A named, ordered stream of documents."""

    spec: str

    @abc.abstractmethod
    def documents(self, stats: SourceStats) -> Iterator[str]:
        """Yield every document in a stable order, counting what was skipped in `stats`."""

    @abc.abstractmethod
    def stat_fingerprint(self) -> str:
        """A cheap hash that changes when the inputs change (file names, sizes, mtimes).

        It keys the prepared-data cache; the exact content hash is computed while preparing.
        """


def decode_utf8(data: bytes, stats: SourceStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        stats.replaced_utf8 += 1
        return data.decode("utf-8", errors="replace")


def clean_str(text: str, stats: SourceStats) -> str:
    """Replace lone surrogates (JSON can encode them) that no tokenizer can take."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        stats.replaced_utf8 += 1
        return _SURROGATE.sub("\ufffd", text)


def stat_hash(spec: str, files: Sequence[Path], extra: str = "") -> str:
    """Hash of a spec and its files' names, sizes and modification times."""
    h = hashlib.sha256(f"{spec}\0{extra}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def expand_paths(pattern: str, *, what: str) -> list[Path]:
    """A file, a directory (walked, hidden entries skipped) or a glob -> sorted files. A URL
    (s3://...) names objects of a store instead, given as StoredPaths (forja/storage/paths.py)."""
    if is_url(pattern):
        from forja.storage.paths import expand

        return expand(pattern, what=what)  # type: ignore[return-value]
    expanded = os.path.expanduser(pattern)
    if _is_glob(expanded):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not files:
            raise ForjaError(f"{what} {pattern!r} matches no file; check the pattern (use ** to recurse)")
        return files
    path = Path(expanded)
    if path.is_file():
        return [path]
    if path.is_dir():
        return _walk(path)
    raise ForjaError(f"{what} {pattern!r} does not exist; check the path")


def _walk(root: Path) -> list[Path]:
    """Every non-hidden file under root, sorted by relative path (stable on every machine)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())
