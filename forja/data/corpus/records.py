"""Record sources: JSON Lines, Parquet and Hugging Face `datasets`, one document per record.

A bad record (a line that is not JSON, a missing or non-text field) stops with its file and
line, unless the user asked to skip bad lines; skipped records are counted either way.
sources.py registers these classes under their spec prefixes; this module builds only on
source_base.py, so the imports run one way.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forja.data.corpus.source_base import Source, SourceStats, clean_str, decode_utf8, expand_paths, stat_hash
from forja.errors import ForjaError
from forja.storage.paths import StoredPath

_SKIP_HINT = "fix it, or pass --skip-bad-lines (skip_bad_lines=True) to skip and count such records"
_HF_BATCH = 1000


def _split_spec(rest: str, kind: str, default_field: str) -> tuple[str, str]:
    scheme, sep, tail = rest.partition("://")  # a URL (s3://...): its own colon is not the field's
    if sep and scheme.isalnum():
        path, _, field = tail.partition(":")
        path = f"{scheme}://{path}"
    else:
        path, _, field = rest.partition(":")
    if not path:
        raise ForjaError(f"source '{kind}:' names no file; write {kind}:PATH[:FIELD]")
    return path, field or default_field


class JsonlSource(Source):
    """`jsonl:PATH[:FIELD]`: each non-blank line is a JSON object whose FIELD is a document."""

    def __init__(self, rest: str, skip_bad_lines: bool):
        pattern, self.field = _split_spec(rest, "jsonl", "text")
        self.spec = f"jsonl:{rest}"
        self.files = expand_paths(pattern, what="JSONL file")
        self.skip_bad_lines = skip_bad_lines

    def documents(self, stats: SourceStats) -> Iterator[str]:
        for path in self.files:
            # path.open: a local Path or a StoredPath (an object streamed from a store)
            with path.open("rb") as raw, (gzip.GzipFile(fileobj=raw) if path.suffix == ".gz"
                                          else contextlib.nullcontext(raw)) as f:
                for lineno, raw in enumerate(f, 1):
                    if raw.strip():
                        text = self._parse(raw, path, lineno, stats)
                        if text is not None:
                            yield stats.count(text)

    def _parse(self, raw: bytes, path: Path, lineno: int, stats: SourceStats) -> str | None:
        try:
            record = json.loads(decode_utf8(raw, stats))
        except json.JSONDecodeError as exc:
            return self._bad(f"{path} line {lineno} is not valid JSON ({exc.msg})", stats)
        value = record.get(self.field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            return self._bad(f"{path} line {lineno} has no text field {self.field!r}", stats)
        return clean_str(value, stats)

    def _bad(self, problem: str, stats: SourceStats) -> None:
        if not self.skip_bad_lines:
            raise ForjaError(f"{problem}; {_SKIP_HINT}")
        stats.skipped_bad_lines += 1
        return None

    def stat_fingerprint(self) -> str:
        return stat_hash(self.spec, self.files, f"skip={self.skip_bad_lines}")


class ParquetSource(Source):
    """`parquet:PATH[:COLUMN]`: each row's COLUMN (default `text`) is a document."""

    def __init__(self, rest: str, skip_bad_lines: bool):
        pattern, self.column = _split_spec(rest, "parquet", "text")
        self.spec = f"parquet:{rest}"
        self.files = expand_paths(pattern, what="Parquet file")
        self.skip_bad_lines = skip_bad_lines
        self._pq = _import("pyarrow.parquet", "parquet")

    def documents(self, stats: SourceStats) -> Iterator[str]:
        for path in self.files:
            pfile = self._pq.ParquetFile(path.open("rb") if isinstance(path, StoredPath) else path)
            names = pfile.schema_arrow.names
            if self.column not in names:
                raise ForjaError(f"{path} has no column {self.column!r} (columns: {', '.join(names)}); "
                                 f"name one as parquet:PATH:COLUMN")
            row = 0
            for batch in pfile.iter_batches(columns=[self.column], batch_size=_HF_BATCH):
                yield from _texts(batch.column(0).to_pylist(), row, f"{path} column {self.column!r}",
                                  self.skip_bad_lines, stats)
                row += batch.num_rows

    def stat_fingerprint(self) -> str:
        return stat_hash(self.spec, self.files, f"skip={self.skip_bad_lines}")


class HfSource(Source):
    """`hf:NAME_OR_PATH[:SPLIT[:FIELD]]` through `datasets`: a local directory or the cache."""

    def __init__(self, rest: str, skip_bad_lines: bool):
        name, _, tail = rest.partition(":")
        split, _, field = tail.partition(":")
        if not name:
            raise ForjaError("source 'hf:' names no dataset; write hf:NAME_OR_PATH[:SPLIT[:FIELD]]")
        self.spec, self.name = f"hf:{rest}", name
        self.split, self.field = split or "train", field or "text"
        self.skip_bad_lines = skip_bad_lines
        self.dataset = self._load()
        if self.field not in self.dataset.column_names:
            raise ForjaError(f"dataset {name!r} split {self.split!r} has no column {self.field!r} "
                             f"(columns: {', '.join(self.dataset.column_names)}); "
                             f"write hf:{name}:{self.split}:COLUMN")

    def _load(self) -> Any:
        datasets = _import("datasets", "hf")
        local = Path(self.name).expanduser()
        try:
            if local.is_dir() and (
                (local / "state.json").exists() or (local / "dataset_dict.json").exists()
            ):
                loaded = datasets.load_from_disk(str(local))  # written by save_to_disk
                return loaded[self.split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(str(local) if local.is_dir() else self.name, split=self.split)
        except (FileNotFoundError, ValueError, KeyError, ConnectionError, OSError) as exc:
            raise ForjaError(f"could not load dataset {self.name!r} split {self.split!r} ({exc}); "
                             f"give a local dataset directory or a name in the local HF cache") from exc

    def documents(self, stats: SourceStats) -> Iterator[str]:
        data = self.dataset.select_columns([self.field])
        where = f"dataset {self.name!r} column {self.field!r}"
        for row, batch in enumerate(data.iter(batch_size=_HF_BATCH)):
            yield from _texts(batch[self.field], row * _HF_BATCH, where, self.skip_bad_lines, stats)

    def stat_fingerprint(self) -> str:
        # datasets fingerprints each Dataset from its files or its state.json.
        return stat_hash(self.spec, [], str(getattr(self.dataset, "_fingerprint", "")))


def _texts(values: list[Any], first_row: int, where: str, skip: bool, stats: SourceStats) -> Iterator[str]:
    for row, value in enumerate(values, first_row):
        if isinstance(value, str):
            yield stats.count(value)
        elif skip:
            stats.skipped_bad_lines += 1
        else:
            raise ForjaError(f"{where} row {row} holds {type(value).__name__}, not text; {_SKIP_HINT}")


def _import(module: str, extra: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise ForjaError(f"this source needs {module.split('.')[0]}: pip install 'forja[{extra}]'") from exc
