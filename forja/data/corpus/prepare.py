"""`forja prepare`: tokenize a source into memory-mappable shards, with all cores.

The output is written to a hidden temporary directory beside `out` and renamed into place
only when complete, so an interrupted run leaves nothing that looks like prepared data. The
output is a function of the inputs alone (not of the worker count or the time), so running
again on the same inputs gives byte-identical files.

`open_dataset` is what the trainer calls: a prepared directory opens as it is; a source spec
is prepared on first use into a cache keyed by (source, tokenizer, options) under
$FORJA_CACHE (default ~/.cache/forja). Only one process should prepare (rank 0, then a
barrier): concurrent runs stay correct (the rename is atomic, the loser's copy is dropped)
but do the work twice.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import forja
from forja.data.corpus.encoding import DIGEST_BYTES, Encoded, EncoderPool, batches, val_threshold
from forja.data.corpus.mixture import Mixture, is_mixture_dir, open_mixture, write_mixture
from forja.data.corpus.parts import (
    PartDone,
    check_out,
    check_part_args,
    check_parts,
    merged,
    merged_stats,
    prepare_part,
    read_parts,
)
from forja.data.corpus.progress import PrepareProgress
from forja.data.corpus.shards import (
    FORMAT,
    FORMAT_VERSION,
    META,
    PreparedDataset,
    ShardWriter,
    open_prepared,
    take_document,
    token_dtype,
    write_json,
)
from forja.data.corpus.sources import Source, SourceStats, parse_mixture, parse_source
from forja.data.corpus.store import open_stored, to_store
from forja.data.corpus.tokenizer import Tokenizer, load_tokenizer
from forja.errors import ForjaError
from forja.files import DiskFull, no_room, replace_dir
from forja.storage import is_url
from forja.storage.blocks import cache_root  # $FORJA_CACHE, else ~/.cache/forja: where prepared data is cached

DEFAULT_VAL_FRACTION = 0.01
TOKENIZER = "tokenizer.json"
# 2^27 tokens: 256 MiB per uint16 shard, few files even for very large corpora.
DEFAULT_SHARD_TOKENS = 1 << 27
# About 1 MB of text per encode call: big enough to amortize the round trip to a worker,
# small enough to keep every worker busy on a small corpus.
DEFAULT_BATCH_CHARS = 1 << 20

SourceArg = str | Sequence[tuple[str, float]]


def default_workers() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@to_store  # an object-store `out` (s3://...): staged locally, then uploaded, meta.json last
def prepare(
    source: SourceArg,
    tokenizer: Tokenizer | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    batch_chars: int = DEFAULT_BATCH_CHARS,
    part: int | None = None,
    parts: int | None = None,
    merge: bool = False,
) -> PreparedDataset | Mixture | PartDone:
    """Tokenize `source` (a spec or a mixture) into `out`; return the opened result.

    A mixture is written as one subdirectory per part plus mixture.json (see mixture.py).
    Every input is checked before any work, and nothing appears at `out` unless all succeeds.
    With `part=K, parts=N`, only the K-th of N shares is tokenized, into out/.parts/ (and its
    PartDone returned); `merge=True` then writes `out` from the N parts, exactly as without
    them (parts.py). `parts` may be given to the merge too, to check the count.
    """
    tok = load_tokenizer(tokenizer)
    check_part_args(part, parts, merge)
    pairs = parse_mixture(source)
    sources = [parse_source(spec, skip_bad_lines=skip_bad_lines) for spec, _ in pairs]
    _check_options(tok, val_fraction, shard_tokens)
    out = Path(out).expanduser()
    workers = workers or default_workers()
    if part is not None or merge:
        check_out(out, overwrite)
        weighted = [(src, w) for src, (_, w) in zip(sources, pairs, strict=True)]
        recorded = dict(val_fraction=val_fraction, shard_tokens=shard_tokens, skip_bad_lines=skip_bad_lines)
        if not merge:
            return prepare_part(weighted, tok, out, part=part, parts=parts, options=recorded,  # type: ignore[arg-type]
                                workers=workers, progress=progress, batch_chars=batch_chars)
        return _merge(weighted, tok, out, parts, recorded, progress, source, pairs)
    if out.exists() and not overwrite:
        raise ForjaError(f"{out} already exists; choose another --out or pass --overwrite to replace it")
    options = dict(val_fraction=val_fraction, workers=workers, shard_tokens=shard_tokens,
                   progress=progress, batch_chars=batch_chars)
    with _staging(out, overwrite, source) as tmp:
        if len(sources) == 1:
            _prepare_one(sources[0], tok, tmp, **options)
        else:
            for i, src in enumerate(sources):
                _prepare_one(src, tok, tmp / str(i), **options)
            write_mixture(tmp, [(str(i), spec, w) for i, (spec, w) in enumerate(pairs)])
        tok.save(tmp / TOKENIZER)  # prepared data carries its tokenizer: decodable on its own
    return open_dataset(out, tok)


def _merge(sources: list[tuple[Source, float]], tok: Tokenizer, out: Path, parts: int | None,
           options: dict[str, Any], progress: bool, source: SourceArg,
           pairs: list[tuple[str, float]]) -> PreparedDataset | Mixture:
    """Write `out` from its finished parts, through the same writer and staging as `prepare`."""
    records = read_parts(out, parts)  # every refusal comes before anything is written
    check_parts(records, sources, tok, options, out)
    dtype = token_dtype(tok.vocab_size)
    # `out` holds only the parts (check_out): it is replaced whole, and the parts go with it.
    with _staging(out, True, source) as tmp:
        for i, (src, _) in enumerate(sources):
            with PrepareProgress(f"{src.spec} (merging {len(records)} parts)", enabled=progress) as bar:
                write_prepared(merged(out, records, i, dtype, options["val_fraction"]), merged_stats(records, i),
                               src.spec, tok, tmp if len(sources) == 1 else tmp / str(i),
                               val_fraction=options["val_fraction"], shard_tokens=options["shard_tokens"], bar=bar)
        if len(sources) > 1:
            write_mixture(tmp, [(str(i), spec, w) for i, (spec, w) in enumerate(pairs)])
        tok.save(tmp / TOKENIZER)
    return open_dataset(out, tok)


def _check_options(tok: Tokenizer, val_fraction: float, shard_tokens: int) -> None:
    if tok.eos_id is None:
        raise ForjaError("the tokenizer has no end-of-document token (like <|eos|> or <|endoftext|>); "
                         "name one as eos_token in a tokenizer_config.json beside it, or train one "
                         "with `forja tokenizer train`")
    if not 0.0 <= val_fraction < 1.0:
        raise ForjaError(f"--val-fraction {val_fraction} is out of range; give a number in [0, 1)")
    if shard_tokens < 1:
        raise ForjaError(f"--shard-tokens {shard_tokens} must be a positive number of tokens")


@contextlib.contextmanager
def _staging(out: Path, overwrite: bool, source: SourceArg) -> Iterator[Path]:
    """A temporary directory beside `out`, renamed to `out` on success and removed on failure."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # on a full disk, even a directory may not fit
        _remove_stale(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        # Without overwrite, an `out` that appeared meanwhile is another process's copy of the
        # same inputs (the output is a function of them): it wins and ours is dropped.
        replace_dir(tmp, out, keep_existing=not overwrite)
    except BaseException as exc:  # KeyboardInterrupt too: leave nothing half-written behind
        shutil.rmtree(tmp, ignore_errors=True)
        error = no_room(exc)
        if error is None:
            raise
        kept = f"the previous {out.name} is kept whole" if os.path.lexists(out) else "nothing was left behind"
        if out.resolve().is_relative_to(cache_root().resolve()):  # prepared on first use: say what
            raise DiskFull(f"the prepared copy of {source} in {out}", error, kept=kept,
                           fix="free some space, or set FORJA_CACHE to a disk with room") from exc
        raise DiskFull(out, error, kept=kept, fix="free some space, or give another --out") from exc


def _remove_stale(out: Path) -> None:
    """Remove what killed runs (SIGKILL, power loss) left: partial dirs of processes now gone."""
    for partial in out.parent.glob(f".{glob.escape(out.name)}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prepare_one(src: Source, tok: Tokenizer, directory: Path, *, val_fraction: float, workers: int,
                 shard_tokens: int, progress: bool, batch_chars: int) -> None:
    dtype = token_dtype(tok.vocab_size)
    stats = SourceStats()
    with EncoderPool(tok, dtype, val_threshold(val_fraction), workers) as pool, \
            PrepareProgress(src.spec, enabled=progress) as bar:
        encoded = pool.map(batches(src.documents(stats), batch_chars))
        write_prepared(encoded, stats, src.spec, tok, directory, val_fraction=val_fraction,
                       shard_tokens=shard_tokens, bar=bar)


def write_prepared(encoded: Iterable[Encoded], stats: SourceStats, spec: str, tok: Tokenizer, directory: Path,
                   *, val_fraction: float, shard_tokens: int, bar: PrepareProgress | None = None) -> None:
    """Write encoded documents, in source order, as one prepared directory (shards + meta.json).

    The one writer of prepared data: `forja prepare` feeds it from its encoder pool, and
    `--merge` (parts.py) from the parts' files, so both write the same bytes. `stats` is read
    once `encoded` is exhausted (a source counts as it is read).
    """
    directory.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: ShardWriter(directory, s, dtype, shard_tokens) for s in ("train", "val")}
    digest, lowest = hashlib.sha256(), _LowestHash()
    for enc in encoded:
        lowest.update(enc, first_index=writers["train"].documents)
        token_is_val = np.repeat(enc.is_val, enc.lengths)
        writers["val"].add(enc.tokens[token_is_val], enc.lengths[enc.is_val])
        writers["train"].add(enc.tokens[~token_is_val], enc.lengths[~enc.is_val])
        digest.update(enc.digests)
        if bar is not None:
            bar.advance(len(enc.lengths), len(enc.tokens))
    splits = {s: w.close() for s, w in writers.items()}
    if stats.documents == 0 or stats.characters == 0:
        raise ForjaError(f"source {spec!r} holds no text ({_counts(stats)}); check the source")
    if val_fraction > 0 and splits["val"]["documents"] == 0 and splits["train"]["documents"] >= 2:
        # A small corpus (14 files at 1%) often has no hash below the threshold: the document
        # with the lowest hash, the first to join at a larger fraction, validates alone.
        moved = take_document(directory, splits["train"], lowest.index, dtype)
        val = ShardWriter(directory, "val", dtype, shard_tokens)
        val.add(moved, np.array([len(moved)], dtype=np.int64))
        splits["val"] = val.close()
    if splits["train"]["documents"] == 0:
        raise ForjaError(f"every document of {spec!r} went to the validation split; lower the validation "
                         f"fraction (--val-fraction, or data.val_fraction in a config) or add documents")
    write_json(directory / META, {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "forja_version": forja.__version__,
        "tokenizer": {"fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "source": {"spec": spec, "fingerprint": digest.hexdigest(), **vars(stats)},
        "splits": splits,
    })


class _LowestHash:
    """The training document with the lowest split hash seen so far (its index in the split)."""

    def __init__(self) -> None:
        self.key, self.index = 1 << 64, -1

    def update(self, enc: Encoded, first_index: int) -> None:
        # A document's split hash is the first 8 bytes of its digest, little-endian (encoding.py).
        keys = np.frombuffer(enc.digests, dtype="<u8")[::DIGEST_BYTES // 8][~enc.is_val]
        if len(keys) and int(keys.min()) < self.key:
            where = int(keys.argmin())
            self.key, self.index = int(keys[where]), first_index + where


def _counts(stats: SourceStats) -> str:
    return (f"{stats.documents} documents, {stats.skipped_binary} binary files skipped, "
            f"{stats.skipped_bad_lines} bad lines skipped")


# --- the cache the trainer uses ----------------------------------------------------------


def cache_key(source: str, tokenizer: Tokenizer, *, val_fraction: float = DEFAULT_VAL_FRACTION,
              shard_tokens: int = DEFAULT_SHARD_TOKENS, skip_bad_lines: bool = False) -> str:
    """A stable key for preparing one source spec (no weight) with a tokenizer and options.

    It changes when the source's files change (names, sizes, mtimes), the tokenizer changes,
    an option changes or the format does.
    """
    src = parse_source(source, skip_bad_lines=skip_bad_lines)
    key = json.dumps([FORMAT_VERSION, src.spec, src.stat_fingerprint(), tokenizer.fingerprint,
                      val_fraction, shard_tokens, skip_bad_lines])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def prepare_cached(source: SourceArg, tokenizer: Tokenizer | str | os.PathLike[str], *,
                   cache: str | os.PathLike[str] | None = None, **options: Any) -> PreparedDataset | Mixture:
    """Prepare each part of `source` once into the cache and open the result. A part that is
    itself a prepared directory (`"data/web:0.7,data/code:0.3"`) opens as it is."""
    tok = load_tokenizer(tokenizer)
    root = Path(cache).expanduser() if cache is not None else cache_root()
    keyed = {k: options[k] for k in ("val_fraction", "shard_tokens", "skip_bad_lines") if k in options}
    opened = []
    for spec, weight in parse_mixture(source):
        if (Path(spec).expanduser() / META).is_file():
            opened.append((open_prepared(Path(spec).expanduser(), tok), weight))
            continue
        out = root / "prepared" / cache_key(spec, tok, **keyed)
        cached = (out / META).is_file()
        if not cached or _lacks_validation(out):
            prepare(spec, tok, out, overwrite=cached, **options)
        opened.append((open_prepared(out, tok, source=spec), weight))
    return opened[0][0] if len(opened) == 1 else Mixture.of(opened)


def _lacks_validation(out: Path) -> bool:
    """A cached copy by an older forja, which left a small corpus without validation documents."""
    try:
        meta = json.loads((out / META).read_text(encoding="utf-8"))
        return (meta["val_fraction"] > 0 and meta["splits"]["val"]["documents"] == 0
                and meta["splits"]["train"]["documents"] >= 2)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # damaged: opening it says so, naming the fix


def open_dataset(path_or_source: SourceArg | os.PathLike[str], tokenizer: Any = None,
                 **options: Any) -> PreparedDataset | Mixture:
    """A prepared directory, a mixture directory, or a source spec prepared on first use.

    With a tokenizer, the data is checked to have been prepared with it.
    """
    if not isinstance(path_or_source, (str, os.PathLike)):
        if tokenizer is None:
            raise ForjaError("a mixture of sources needs a tokenizer to be prepared")
        return prepare_cached(path_or_source, tokenizer, **options)
    if is_url(path_or_source):  # prepared data on an object store, read by ranges (store.py)
        return open_stored(str(path_or_source), tokenizer)
    path = Path(path_or_source).expanduser()
    if (path / META).is_file():
        return open_prepared(path, load_tokenizer(tokenizer) if tokenizer is not None else None)
    if is_mixture_dir(path):
        return open_mixture(path, load_tokenizer(tokenizer) if tokenizer is not None else None)
    if tokenizer is None:
        raise ForjaError(f"{path_or_source} is not a prepared data directory; run `forja prepare`, "
                         f"or give a tokenizer so it is prepared on first use")
    return prepare_cached(str(path_or_source), tokenizer, **options)
