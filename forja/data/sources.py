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
"""

from __future__ import annotations

import abc
import glob
import hashlib
import os
import re
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from forja.errors import ForjaError

# git's heuristic: a NUL byte in the first 8 KiB marks a file as binary.
_BINARY_SNIFF_BYTES = 8192
_SURROGATE = re.compile("[\ud800-\udfff]")
_WEIGHT = re.compile(r"^(?P<spec>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


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
    """A file, a directory (walked, hidden entries skipped) or a glob -> sorted files."""
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


# Record-based formats (jsonl, parquet, hf) register themselves on import.
from forja.data import records as _records  # noqa: E402,F401  (import for registration)
