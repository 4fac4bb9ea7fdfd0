"""Document sources: one spec string names where the text comes from.

A source yields documents (Python strings) in a stable order, so that preparing the same
inputs twice gives the same bytes. Spec forms (see docs/data.md):

    data/*.txt, ~/code/**/*.py, some/dir   files; each file is one document
    jsonl:PATH[:FIELD]                     one document per JSON line (field `text` by default)
    parquet:PATH[:COLUMN]                  one document per row (column `text`; needs pyarrow)
    hf:NAME_OR_PATH[:SPLIT[:FIELD]]        a Hugging Face `datasets` dataset, local dir or cache
    stdlib[:SUBDIR]                        the running interpreter's standard library `.py` files

A mixture is several specs with weights, `"stdlib:0.7,jsonl:x.jsonl:0.3"`: parts are split on
commas and a trailing `:NUMBER` is always the part's weight (so a JSONL field or an HF split
cannot be a bare number). Weights act in the loader, which interleaves samples by weight.

New kinds of source register here with `@register_source("prefix")` (a real seam: data source).
The built-in kinds register at the bottom of this file. Imports run one way: this module ->
records.py (the record formats) -> source_base.py (`Source`, `SourceStats`, shared helpers,
re-exported here so `from forja.data.corpus.sources import SourceStats` keeps working).
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from forja.data.corpus.records import HfSource, JsonlSource, ParquetSource
from forja.data.corpus.source_base import Source, SourceStats, clean_str, decode_utf8, expand_paths, stat_hash
from forja.errors import ForjaError

__all__ = [
    "FileSource", "HfSource", "JsonlSource", "ParquetSource", "Source", "SourceFactory", "SourceStats",
    "clean_str", "decode_utf8", "expand_paths", "parse_mixture", "parse_source", "read_text_file",
    "register_source", "stat_hash", "stdlib_files", "stdlib_root",
]

# git's heuristic: a NUL byte in the first 8 KiB marks a file as binary.
_BINARY_SNIFF_BYTES = 8192
_WEIGHT = re.compile(r"^(?P<spec>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")

SourceFactory = Callable[[str, bool], Source]
_REGISTRY: dict[str, SourceFactory] = {}


def register_source(prefix: str) -> Callable[[SourceFactory], SourceFactory]:
    """Register `factory(rest_of_spec, skip_bad_lines) -> Source` for specs `prefix:...`."""

    def wrap(factory: SourceFactory) -> SourceFactory:
        _REGISTRY[prefix] = factory
        return factory

    return wrap


def parse_source(spec: str, *, skip_bad_lines: bool = False) -> Source:
    """Turn one spec (no weight) into a Source, checking that its inputs exist."""
    spec = spec.strip()
    if not spec:
        raise ForjaError("the source spec is empty; name a path, glob, jsonl:, parquet:, hf: or stdlib")
    prefix, _, rest = spec.partition(":")
    if prefix in _REGISTRY:
        return _REGISTRY[prefix](rest, skip_bad_lines)
    return FileSource(spec)


def parse_mixture(spec: str | Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
    """Split a mixture spec into (spec, weight) pairs; a plain spec is a mixture of one."""
    if isinstance(spec, str):
        pairs = []
        for part in (p.strip() for p in spec.split(",")):
            match = _WEIGHT.match(part)
            pairs.append((match["spec"], float(match["weight"])) if match else (part, 1.0))
    else:
        pairs = [(str(s), float(w)) for s, w in spec]
    if not pairs or any(not s for s, _ in pairs):
        raise ForjaError(f"source {spec!r} has an empty part; write parts as SPEC[:WEIGHT] joined by commas")
    for part, weight in pairs:
        if not weight > 0:
            raise ForjaError(f"source {part!r} has weight {weight}; weights must be positive numbers")
    return pairs


# --- reading files -------------------------------------------------------------------------


def read_text_file(path: Path, stats: SourceStats) -> str | None:
    """Read one file as a document: None (and counted) if binary, invalid UTF-8 replaced."""
    data = path.read_bytes()
    if b"\0" in data[:_BINARY_SNIFF_BYTES]:
        stats.skipped_binary += 1
        return None
    return decode_utf8(data, stats)


class FileSource(Source):
    """Text files named by a path, directory or glob; each file is one document."""

    def __init__(self, spec: str, files: list[Path] | None = None):
        self.spec = spec
        self.files = files if files is not None else expand_paths(spec, what="source path")

    def documents(self, stats: SourceStats) -> Iterator[str]:
        for path in self.files:
            text = read_text_file(path, stats)
            if text is not None:
                yield stats.count(text)

    def stat_fingerprint(self) -> str:
        return stat_hash(self.spec, self.files)


def stdlib_root() -> Path:
    """The running interpreter's standard library directory (also inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(subdir: str = "") -> list[Path]:
    """The stdlib `.py` files in sorted relative order, without installed packages."""
    root = stdlib_root()
    base = root / subdir if subdir else root
    if not base.is_dir():
        raise ForjaError(f"source 'stdlib:{subdir}': {base} is not a directory of the standard library")
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Installed packages differ between machines: the corpus must not.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@register_source("stdlib")
def _stdlib(rest: str, skip_bad_lines: bool) -> Source:
    subdir = rest.strip("/")
    source = FileSource(f"stdlib:{subdir}" if subdir else "stdlib", stdlib_files(subdir))
    return source


# The record formats live in records.py, which knows nothing of this registry.
register_source("jsonl")(JsonlSource)
register_source("parquet")(ParquetSource)
register_source("hf")(HfSource)
