"""Preparation across many machines: N independent workers, then one merge.

    forja prepare ARGS --part K --parts N     on N workers (a SLURM array, torchrun ranks, ...)
    forja prepare ARGS --merge                once, when every part is done

Each worker tokenizes its share of every source into OUT/.parts/KKKKK/ (one folder per
mixture component) and writes part.json there last: a part without it is unfinished. A part
holds the encoded documents in source order, as they came out of the encoder pool: tokens
(end-of-document included), lengths and the per-document digests. It splits nothing into
train and validation and cuts no shards, because both depend on the whole corpus (shard
boundaries on every earlier document, the small-corpus validation document on the lowest
hash of all). The merge reads the parts back in source order and hands them to the same
writer as `forja prepare` (prepare.write_prepared), so its directory is byte for byte the one
a single `forja prepare ARGS` writes.

How a source is divided, without counting its documents first:

- "files": a list of files (a directory, a glob, stdlib; JSONL or Parquet with at least as
  many files as parts) is cut into N contiguous runs of files, balanced by size. The merge
  concatenates the parts in order.
- "blocks": anything else (one JSONL or Parquet file, a Hugging Face dataset) is cut into
  blocks of BLOCK_DOCUMENTS documents dealt round robin: block j belongs to part j mod N.
  Every worker reads the whole source but tokenizes only its blocks; the merge deals them
  back in the same order.

Files are written through the small helpers at the bottom (_create, _write_record,
_read_record, _folders, _remove), so that they can be pointed at an object store.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

import forja
from forja.data.corpus.encoding import DIGEST_BYTES, Encoded, EncoderPool, batches, val_threshold
from forja.data.corpus.progress import PrepareProgress
from forja.data.corpus.records import JsonlSource, ParquetSource
from forja.data.corpus.shards import token_dtype, write_json
from forja.data.corpus.sources import FileSource, Source, SourceStats
from forja.data.corpus.tokenizer import Tokenizer
from forja.errors import ForjaError
from forja.files import fsync_dir

PARTS_DIR = ".parts"
MARKER = "part.json"
BLOCK_DOCUMENTS = 1024
_FORMAT = "forja-prepare-part"
_FORMAT_VERSION = 1
# The options a part records and the merge must be given alike (key -> the flag that sets it).
_OPTIONS = {"val_fraction": "--val-fraction", "shard_tokens": "--shard-tokens", "skip_bad_lines": "--skip-bad-lines"}
# At most this many documents and (but for one long document) tokens per piece the merge
# hands to the writer: bounded memory whatever a part holds.
_MERGE_DOCUMENTS, _MERGE_TOKENS = 1 << 16, 1 << 24


@dataclass(frozen=True)
class PartDone:
    """What one worker wrote: part `part` of `parts`, in `path`."""

    part: int
    parts: int
    path: Path
    documents: int
    tokens: int
    seconds: float


def check_part_args(part: int | None, parts: int | None, merge: bool) -> None:
    """One sentence for each combination of --part, --parts and --merge that cannot run."""
    if merge and part is not None:
        raise ForjaError(f"--merge takes no --part (it was given --part {part}): run each worker with "
                         f"--part K --parts N, then --merge once, with the same other options")
    if parts is not None and parts < 1:
        raise ForjaError(f"--parts {parts} must be at least 1 (the number of workers)")
    if part is not None and parts is None:
        raise ForjaError(f"--part {part} needs --parts N, the number of workers (parts 0 to N-1)")
    if part is None and parts is not None and not merge:
        raise ForjaError(f"--parts {parts} needs --part K, this worker's number from 0 to {parts - 1} "
                         f"(or --merge, to combine finished parts)")
    if part is not None and parts is not None and not 0 <= part < parts:
        raise ForjaError(f"--part {part} is out of range for --parts {parts}; give 0 to {parts - 1}")


def check_out(out: Path, overwrite: bool) -> None:
    """Workers and the merge write into `out` only if it is new, holds only parts, or --overwrite."""
    if out.is_file() or (out.is_dir() and not overwrite and any(p.name != PARTS_DIR for p in out.iterdir())):
        raise ForjaError(f"{out} already exists; choose another --out or pass --overwrite to replace it")


# --- a worker ------------------------------------------------------------------------------


def prepare_part(sources: list[tuple[Source, float]], tok: Tokenizer, out: Path, *, part: int, parts: int,
                 options: dict[str, Any], workers: int, progress: bool, batch_chars: int) -> PartDone:
    """Tokenize part `part` of `parts` of every source into out/.parts/; a rerun replaces it."""
    folder = out / PARTS_DIR / f"{part:05d}"
    started = time.perf_counter()
    _remove(folder)  # its part.json first: from here on the part counts as unfinished
    try:
        components = [_encode_share(src, weight, tok, folder / str(i), part, parts, workers=workers,
                                    progress=progress, batch_chars=batch_chars, val_fraction=options["val_fraction"])
                      for i, (src, weight) in enumerate(sources)]
        seconds = time.perf_counter() - started
        _write_record(folder / MARKER, {  # last: the part counts as done only now
            "format": _FORMAT, "format_version": _FORMAT_VERSION, "forja_version": forja.__version__,
            "part": part, "parts": parts, "tokenizer": tok.fingerprint, "options": options,
            "sources": components, "seconds": seconds,
        })
    except BaseException:  # an interrupted worker leaves no half of a part behind
        _remove(folder)
        raise
    return PartDone(part, parts, folder, sum(c["documents"] for c in components),
                    sum(c["tokens"] for c in components), seconds)


def _encode_share(src: Source, weight: float, tok: Tokenizer, folder: Path, part: int, parts: int, *,
                  workers: int, progress: bool, batch_chars: int, val_fraction: float) -> dict[str, Any]:
    stats = SourceStats()
    # Taken before reading: a file that changes while the worker reads it fails the merge's check.
    fingerprint, kind = src.stat_fingerprint(), split_kind(src, parts)
    if kind == "files":
        lo, hi = file_range(src, part, parts)
        share = copy.copy(src)
        share.files = src.files[lo:hi]  # type: ignore[attr-defined]
        documents, where = share.documents(stats), {"files": [lo, hi]}
    else:
        block = BLOCK_DOCUMENTS
        documents, where = _blocks(src, part, parts, block, stats), {"block": block}
    dtype = token_dtype(tok.vocab_size)
    count = tokens = 0
    with _create(folder / "tokens.bin") as tokens_file, _create(folder / "lengths.bin") as lengths_file, \
            _create(folder / "digests.bin") as digests_file, \
            EncoderPool(tok, dtype, val_threshold(val_fraction), workers) as pool, \
            PrepareProgress(f"{src.spec} (part {part} of {parts})", enabled=progress) as bar:
        for enc in pool.map(batches(documents, batch_chars)):
            tokens_file.write(enc.tokens.tobytes())
            lengths_file.write(enc.lengths.astype("<i8").tobytes())
            digests_file.write(enc.digests)
            count, tokens = count + len(enc.lengths), tokens + len(enc.tokens)
            bar.advance(len(enc.lengths), len(enc.tokens))
    return {"spec": src.spec, "weight": weight, "stat_fingerprint": fingerprint, "split": kind,
            **where, "documents": count, "tokens": tokens, "stats": vars(stats)}


def split_kind(src: Source, parts: int) -> str:
    """"files" where the source is a list of files to cut into runs, else "blocks" (module doc)."""
    if type(src) is FileSource:
        return "files"
    if type(src) in (JsonlSource, ParquetSource) and len(src.files) >= parts:  # type: ignore[attr-defined]
        return "files"
    return "blocks"


def file_range(src: Source, part: int, parts: int) -> tuple[int, int]:
    """Part `part`'s files [lo, hi) (see file_ranges)."""
    return file_ranges(src, parts)[part]


def file_ranges(src: Source, parts: int) -> list[tuple[int, int]]:
    """Each part's files [lo, hi): a file goes to the part its middle byte falls in, of N equal
    byte ranges over the files back to back (contiguous, balanced by size to within a file, the
    same on every machine that sees the same files)."""
    sizes = [f.stat().st_size for f in src.files]  # type: ignore[attr-defined]
    total, start, counts = sum(sizes), 0, [0] * parts
    for i, size in enumerate(sizes):
        counts[min(parts - 1, (2 * start + size) * parts // (2 * total)) if total else i * parts // len(sizes)] += 1
        start += size
    ends = np.cumsum([0, *counts]).tolist()
    return list(zip(ends[:-1], ends[1:], strict=True))


def _blocks(src: Source, part: int, parts: int, block: int, stats: SourceStats) -> Iterator[str]:
    """The documents of this part's blocks; `stats` counts what reading them did (a record skipped
    before a document counts with that document's block, those after the last with the next)."""
    seen = SourceStats()
    before, index = dict(vars(seen)), 0
    for doc in src.documents(seen):
        if (index // block) % parts == part:
            _add_since(stats, seen, before)
            yield doc
        before, index = dict(vars(seen)), index + 1
    if (index // block) % parts == part:
        _add_since(stats, seen, before)


def _add_since(stats: SourceStats, seen: SourceStats, before: dict[str, int]) -> None:
    for name, value in vars(seen).items():
        setattr(stats, name, getattr(stats, name) + value - before[name])


def block_counts(total: int, parts: int, block: int) -> list[int]:
    """Documents each part holds when `total` documents are dealt in blocks, round robin."""
    full, rest = divmod(total, block)
    return [block * (full // parts + (k < full % parts)) + (rest if full % parts == k else 0) for k in range(parts)]


# --- the merge -----------------------------------------------------------------------------


def read_parts(out: Path, parts: int | None) -> list[dict[str, Any]]:
    """Every part's record, in order; refuses, naming them, while parts are missing or disagree on N."""
    found = {}
    for folder in _folders(out / PARTS_DIR):
        if folder.name.isdigit() and (folder / MARKER).is_file():
            found[int(folder.name)] = _read_record(folder / MARKER)
    if not found:
        raise ForjaError(f"{out} holds no finished part to merge; run `forja prepare ARGS --part K --parts N` "
                         f"for every K from 0 to N-1 first, then `forja prepare ARGS --merge`")
    counts = Counter(r.get("parts") for r in found.values())
    n = parts if parts is not None else counts.most_common(1)[0][0]
    other = sorted(k for k, r in found.items() if r.get("parts") != n)
    if other:
        raise ForjaError(f"{_numbered(other)} under {out / PARTS_DIR} {'was' if len(other) == 1 else 'were'} "
                         f"prepared with another --parts than {n}; delete {'it' if len(other) == 1 else 'them'} "
                         f"and run the {n} parts with the same --parts")
    missing = [k for k in range(n) if k not in found]
    if missing:
        ks = ", ".join(map(str, missing))
        raise ForjaError(f"{_numbered(missing)} of {n} under {out / PARTS_DIR} {'is' if len(missing) == 1 else 'are'} "
                         f"missing or unfinished; run `forja prepare ARGS --part K --parts {n}` for K in {ks} "
                         f"(the same ARGS as the other parts), then --merge again")
    return [found[k] for k in range(n)]


def check_parts(records: list[dict[str, Any]], sources: list[tuple[Source, float]], tok: Tokenizer,
                options: dict[str, Any], out: Path) -> None:
    """Stop, naming the part, unless every part was made by these ARGS from these inputs."""
    n = len(records)
    # How each source divides now (stat-ing every file once, not once per part).
    plans = [(src.stat_fingerprint(), split_kind(src, n),
              file_ranges(src, n) if split_kind(src, n) == "files" else None) for src, _ in sources]
    for k, rec in enumerate(records):
        name = f"part {k} of {n} under {out / PARTS_DIR}"
        rerun = f"rerun it with `forja prepare ARGS --part {k} --parts {n}` and the merge's ARGS"
        if rec.get("format") != _FORMAT or rec.get("format_version") != _FORMAT_VERSION:
            raise ForjaError(f"{name} was written by another version of forja; {rerun}")
        if rec["tokenizer"] != tok.fingerprint:
            raise ForjaError(f"{name} was tokenized with the tokenizer of fingerprint {rec['tokenizer'][:12]}, "
                             f"not --tokenizer's {tok.fingerprint[:12]}; {rerun}, or merge with the tokenizer it used")
        for key, flag in _OPTIONS.items():
            if rec["options"].get(key) != options[key]:
                raise ForjaError(f"{name} was prepared with {flag} {rec['options'].get(key)}, but the merge is given "
                                 f"{options[key]}; give the merge the parts' options, or {rerun}")
        given = [(src.spec, weight) for src, weight in sources]
        if [(c["spec"], c["weight"]) for c in rec["sources"]] != given:
            raise ForjaError(f"{name} was prepared from source {_spec(rec['sources'])!r}, not "
                             f"{_spec([{'spec': s, 'weight': w} for s, w in given])!r}; {rerun}")
        for (src, _), comp, now in zip(sources, rec["sources"], plans, strict=True):
            if (comp["stat_fingerprint"], comp["split"]) != now[:2] or (
                    comp["split"] == "files" and comp["files"] != list(now[2][k])):
                raise ForjaError(f"source {src.spec!r} changed (its files' names, sizes or modification times) "
                                 f"since {name} was prepared; run every part again, then --merge")
    for c, (src, _) in enumerate(sources):
        held = [rec["sources"][c]["documents"] for rec in records]
        block = records[0]["sources"][c].get("block")
        if records[0]["sources"][c]["split"] == "blocks" and (
                any(rec["sources"][c].get("block") != block for rec in records)
                or held != block_counts(sum(held), n, block)):
            raise ForjaError(f"the parts of {src.spec!r} under {out / PARTS_DIR} hold {held} documents, which no "
                             f"one reading of the source deals out; run every part again, then --merge")


def merged_stats(records: list[dict[str, Any]], component: int) -> SourceStats:
    """What reading the whole source counted: the sum of the parts' counts."""
    stats = SourceStats()
    for rec in records:
        for name, value in rec["sources"][component]["stats"].items():
            setattr(stats, name, getattr(stats, name) + int(value))
    return stats


def merged(out: Path, records: list[dict[str, Any]], component: int, dtype: np.dtype,
           val_fraction: float) -> Iterator[Encoded]:
    """The encoded documents of one source in source order, read back from its parts."""
    threshold = np.uint64(val_threshold(val_fraction))
    readers = [_PartReader(out / PARTS_DIR / f"{k:05d}" / str(component), dtype, threshold)
               for k in range(len(records))]
    if records[0]["sources"][component]["split"] == "files":
        runs: Iterator[tuple[int, int]] = ((k, r.documents) for k, r in enumerate(readers))
    else:
        runs = _dealt([r.documents for r in readers], records[0]["sources"][component]["block"])
    for k, count in runs:
        yield from readers[k].take(count)


def _dealt(held: list[int], block: int) -> Iterator[tuple[int, int]]:
    """(part, documents) in source order for documents dealt in blocks, round robin."""
    left, j = list(held), 0
    while left[j % len(left)]:
        k = j % len(left)
        count = min(block, left[k])
        left[k] -= count
        yield k, count
        j += 1


class _PartReader:
    """One part's files of one source, read forward in pieces."""

    def __init__(self, folder: Path, dtype: np.dtype, threshold: np.uint64):
        self.tokens = _array(folder / "tokens.bin", dtype)
        self.lengths = _array(folder / "lengths.bin", np.dtype("<i8"))
        self.digests = _array(folder / "digests.bin", np.dtype("u1"))
        self.documents, self.threshold = len(self.lengths), threshold
        self._doc = self._token = 0

    def take(self, count: int) -> Iterator[Encoded]:
        end = self._doc + count
        while self._doc < end:
            lo = self._doc
            lengths = np.array(self.lengths[lo:min(end, lo + _MERGE_DOCUMENTS)])
            cut = int(np.searchsorted(np.cumsum(lengths), _MERGE_TOKENS, side="right"))
            lengths = lengths[:max(cut, 1)]  # at least one document, however long
            hi, size = lo + len(lengths), int(lengths.sum())
            digests = self.digests[lo * DIGEST_BYTES:hi * DIGEST_BYTES].tobytes()
            # A document's split hash is the first 8 bytes of its digest, little-endian (encoding.py).
            is_val = np.frombuffer(digests, dtype="<u8")[::DIGEST_BYTES // 8] < self.threshold
            yield Encoded(np.array(self.tokens[self._token:self._token + size]), lengths, is_val, digests, 0)
            self._doc, self._token = hi, self._token + size


def _numbered(parts: list[int]) -> str:
    return f"part {parts[0]}" if len(parts) == 1 else f"parts {', '.join(map(str, parts))}"


def _spec(components: list[dict[str, Any]]) -> str:
    return ",".join(f"{c['spec']}:{c['weight']:g}" for c in components)


# --- storage: the only functions here that touch files -------------------------------------


@contextlib.contextmanager
def _create(path: Path) -> Iterator[BinaryIO]:
    """A new file to append to, flushed to disk when closed (before part.json says it is whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def _write_record(path: Path, data: dict[str, Any]) -> None:
    write_json(path, data)  # atomic: temporary name, then rename
    fsync_dir(path.parent)


def _read_record(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ForjaError(f"{path} is not a valid part record ({exc}); run that part again") from exc


def _folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def _array(path: Path, dtype: np.dtype) -> np.ndarray:
    if not path.is_file():
        raise ForjaError(f"{path} is missing from a finished part; run that part again")
    if path.stat().st_size == 0:  # an empty share (more parts than files): nothing to map
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _remove(path: Path) -> None:
    (path / MARKER).unlink(missing_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
