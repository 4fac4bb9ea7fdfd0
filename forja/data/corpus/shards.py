"""The on-disk format of prepared data, and reading it back through memory maps.

A prepared directory (written by `forja prepare`, see docs/data.md):

    meta.json                     format, tokenizer fingerprint/vocab, dtype, counts, sources
    train/tokens-00000.bin        token ids, raw little-endian uint16 (uint32 for big vocabs)
    train/offsets-00000.npy       int64 [documents + 1]: where each document starts in the shard
    val/...                       the same for the validation split

Every document ends with the end-of-document token and lies in one shard, so its boundaries
are the offsets. Shards are memory-mapped: only the pages a sample touches are read, so a
corpus much larger than RAM works. A prepared directory given as an object-store URL
(`s3://bucket/prepared`) is read the same way by byte ranges through a bounded local block
cache (see remote.py): `_Shard.tokens` is then a RemoteTokens, sliced like the memory map.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from forja.errors import ForjaError
from forja.files import write_atomic
from forja.storage import is_url, join

FORMAT = "forja-prepared"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
META = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536): half the disk and page cache of uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically, keys sorted and indented, so equal data gives equal bytes."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


class ShardWriter:
    """Appends documents of one split to shards of about `shard_tokens` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.documents = self.tokens = 0
        self._file: Any = None
        self._offsets: list[np.ndarray] = []
        self._shard_tokens_written = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as their concatenated tokens and their lengths."""
        start = 0
        while len(lengths):
            room = self.shard_tokens - self._shard_tokens_written
            fit = int(np.searchsorted(np.cumsum(lengths), room, side="right"))
            if fit == 0 and self._shard_tokens_written > 0:
                self._close_shard()
                continue
            fit = max(fit, 1)  # a document larger than a shard gets a shard of its own
            n = int(lengths[:fit].sum())
            self._write(tokens[start:start + n], lengths[:fit])
            start, lengths = start + n, lengths[fit:]

    def _write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if self._file is None:
            index = len(self.shards)
            (self.directory / self.split).mkdir(parents=True, exist_ok=True)
            self._name = f"{self.split}/tokens-{index:05d}.bin"
            self._file = open(self.directory / self._name, "wb")
            self._offsets = [np.zeros(1, dtype=np.int64)]
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._offsets.append(self._shard_tokens_written + np.cumsum(lengths, dtype=np.int64))
        self._shard_tokens_written += int(lengths.sum())
        self.documents += len(lengths)
        self.tokens += int(lengths.sum())

    def _close_shard(self) -> None:
        self._file.close()
        self._file = None
        offsets = np.concatenate(self._offsets)
        offsets_name = self._name.replace("tokens-", "offsets-").replace(".bin", ".npy")
        np.save(self.directory / offsets_name, offsets)
        self.shards.append({"tokens": self._name, "offsets": offsets_name,
                            "documents": len(offsets) - 1, "num_tokens": int(offsets[-1])})
        self._shard_tokens_written = 0

    def close(self) -> dict[str, Any]:
        """Finish the last shard; return this split's entry for meta.json."""
        if self._file is not None:
            self._close_shard()
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}


def take_document(directory: Path, entry: dict[str, Any], index: int, dtype: np.dtype) -> np.ndarray:
    """Remove document `index` from a closed split (`entry`, as ShardWriter.close returned it,
    updated in place) and return its tokens. Only the one shard holding it is rewritten."""
    first = 0
    for i, shard in enumerate(entry["shards"]):
        if index < first + shard["documents"]:
            break
        first += shard["documents"]
    else:
        raise IndexError(f"document {index} out of range [0, {entry['documents']})")
    tokens_path, offsets_path = directory / shard["tokens"], directory / shard["offsets"]
    tokens, offsets = np.fromfile(tokens_path, dtype=dtype), np.load(offsets_path)
    lo, hi = int(offsets[index - first]), int(offsets[index - first + 1])
    taken = tokens[lo:hi].copy()
    entry["documents"] -= 1
    entry["tokens"] -= hi - lo
    if shard["documents"] == 1:  # the shard held only this document: it goes
        del entry["shards"][i]
        tokens_path.unlink()
        offsets_path.unlink()
        return taken
    kept = np.delete(offsets, index - first + 1)
    kept[index - first + 1:] -= hi - lo
    np.concatenate([tokens[:lo], tokens[hi:]]).tofile(tokens_path)
    np.save(offsets_path, kept)
    shard["documents"] -= 1
    shard["num_tokens"] -= hi - lo
    return taken


def _child(root: Path | str, name: str) -> Path | str:
    """`name` under a local directory (a Path) or an object-store URL (a str: Path would fold its "//")."""
    return join(root, name) if isinstance(root, str) else root / name


@dataclass
class _Shard:
    tokens: Any  # (num_tokens,): a memory map, or remote.RemoteTokens (sliced the same way)
    offsets: np.ndarray  # (documents + 1,) int64, starts at 0
    token_start: int  # first token's position in the split's stream
    doc_start: int  # first document's index in the split


class TokenStream:
    """One split as a single stream of tokens over its memory-mapped shards."""

    def __init__(self, root: Path | str, entry: dict[str, Any], dtype: np.dtype, redo: str = "prepare the data again"):
        self.num_documents = int(entry["documents"])
        self.num_tokens = int(entry["tokens"])
        self._shards: list[_Shard] = []
        token_start = doc_start = 0
        infos = None
        if isinstance(root, str):  # one listing per split directory gives every shard's size
            from forja.data.corpus.remote import listing

            infos = listing(root, entry["shards"])
        for shard in entry["shards"]:
            opened = _open_shard(root, shard, dtype, token_start, doc_start, redo, infos)
            self._shards.append(opened)
            token_start += len(opened.tokens)
            doc_start += len(opened.offsets) - 1
        if (token_start, doc_start) != (self.num_tokens, self.num_documents):
            raise ForjaError(f"{_child(root, META)} counts {self.num_tokens} tokens in {self.num_documents} documents "
                             f"but the shards hold {token_start} in {doc_start}; {redo}")
        self._token_starts = np.array([s.token_start for s in self._shards] + [token_start], dtype=np.int64)
        self._doc_starts = np.array([s.doc_start for s in self._shards] + [doc_start], dtype=np.int64)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, across shard ends if need be."""
        return self._gather(start, length, lambda s, lo, hi: s.tokens[lo:hi])

    def document_ids(self, start: int, length: int) -> np.ndarray:
        """For each token in [start, start + length), the index of its document in the split."""

        def ids(s: _Shard, lo: int, hi: int) -> np.ndarray:
            # Two searches and a running count of the document starts inside [lo, hi), not a
            # search per token (a 8k-token row: 35 us instead of 161 us).
            first = int(np.searchsorted(s.offsets, lo, side="right")) - 1
            last = int(np.searchsorted(s.offsets, hi - 1, side="right")) - 1
            starts = np.zeros(hi - lo, dtype=np.int64)
            starts[np.asarray(s.offsets[first + 1:last + 1], dtype=np.int64) - lo] = 1
            return np.cumsum(starts) + (first + s.doc_start)

        return self._gather(start, length, ids)

    def _gather(self, start: int, length: int, take: Any) -> np.ndarray:
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of range [0, {self.num_tokens})")
        first = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        parts, pos, end = [], start, start + length
        for shard in self._shards[first:]:
            if pos >= end:
                break
            lo = pos - shard.token_start
            hi = min(end - shard.token_start, len(shard.tokens))
            parts.append(take(shard, lo, hi))
            pos = shard.token_start + hi
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_bounds(self) -> np.ndarray:
        """Where each document starts in the stream, and the end: (documents + 1,) int64."""
        if not self._shards:
            return np.zeros(1, dtype=np.int64)
        parts = [np.asarray(s.offsets[:-1], dtype=np.int64) + s.token_start for s in self._shards]
        return np.concatenate(parts + [np.array([self.num_tokens], dtype=np.int64)])

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` (its end-of-document token included), a copy."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range [0, {self.num_documents})")
        shard = self._shards[int(np.searchsorted(self._doc_starts, index, side="right")) - 1]
        local = index - shard.doc_start
        return np.array(shard.tokens[shard.offsets[local]:shard.offsets[local + 1]])


def _open_shard(root: Path | str, entry: dict[str, Any], dtype: np.dtype, token_start: int, doc_start: int,
                redo: str, infos: dict[str, Any] | None = None) -> _Shard:
    if isinstance(root, str):
        from forja.data.corpus.remote import open_shard

        return _Shard(*open_shard(root, entry, dtype, redo, infos or {}), token_start, doc_start)
    tokens_path, offsets_path = root / entry["tokens"], root / entry["offsets"]
    try:
        offsets = np.load(offsets_path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise ForjaError(f"offsets file {offsets_path} is missing or damaged ({exc}); {redo}") from exc
    if offsets.ndim != 1 or len(offsets) != int(entry["documents"]) + 1 or offsets[0] != 0:
        raise ForjaError(f"offsets file {offsets_path} does not match {root / META}; {redo}")
    expected = int(offsets[-1]) * dtype.itemsize
    actual = tokens_path.stat().st_size if tokens_path.is_file() else -1
    if actual != expected:
        state = "is missing" if actual < 0 else f"has {actual} bytes"
        raise ForjaError(f"shard {tokens_path} {state} but its offsets need {expected} bytes "
                         f"(truncated or damaged); {redo}")
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
    return _Shard(tokens, offsets, token_start, doc_start)


class PreparedDataset:
    """A directory written by `forja prepare`, read through memory maps.

    `source` is the spec a cached copy was prepared from, as the user gave it: errors then
    name it (`name`), not the cache's hashed directory, and say how to have it prepared again.
    """

    def __init__(self, path: str | os.PathLike[str], *, source: str | None = None):
        self.path: Path | str = str(path).rstrip("/") if is_url(path) else Path(path).expanduser()
        self.cached = source is not None
        self.name = source if source is not None else str(self.path)
        self.redo = ("prepare the data again" if source is None else
                     f"delete {self.path} (the cached copy of {source}) and it is prepared again on next use")
        self.meta: dict[str, Any] = _read_meta(self.path, self.redo)
        self.dtype = np.dtype(self.meta["dtype"])
        self._streams: dict[str, TokenStream] = {}
        for split in SPLITS:  # opening checks every shard's size now, before any training
            self.split(split)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_id"])

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the data's content: the tokenizer, the sources and how they were split."""
        m = self.meta
        key = json.dumps([m["tokenizer"]["fingerprint"], m["source"]["fingerprint"], m["val_fraction"],
                          {s: m["splits"][s]["tokens"] for s in SPLITS}])
        return hashlib.sha256(key.encode()).hexdigest()

    def split(self, name: str) -> TokenStream:
        if name not in SPLITS:
            raise ForjaError(f"unknown split {name!r}; use one of {', '.join(SPLITS)}")
        if name not in self._streams:
            self._streams[name] = TokenStream(self.path, self.meta["splits"][name], self.dtype, self.redo)
        return self._streams[name]

    def num_documents(self, split: str = "train") -> int:
        return self.split(split).num_documents

    def num_tokens(self, split: str = "train") -> int:
        return self.split(split).num_tokens

    def document(self, split: str, index: int) -> np.ndarray:
        """Token ids of document `index` of `split`, end-of-document token included."""
        return self.split(split).document(index)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Stop unless `tokenizer` is the one this data was prepared with."""
        recorded = self.meta["tokenizer"]
        if tokenizer.vocab_size != recorded["vocab_size"]:
            raise ForjaError(f"the tokenizer has {tokenizer.vocab_size} tokens but {self.name} was prepared "
                             f"with {recorded['vocab_size']}; use the tokenizer it was prepared with "
                             f"or {self.redo}")
        if tokenizer.fingerprint != recorded["fingerprint"]:
            where = self.name if self.cached else _child(self.path, META)
            raise ForjaError(f"the tokenizer's fingerprint {tokenizer.fingerprint[:12]} differs from "
                             f"{recorded['fingerprint'][:12]} recorded in {where}; use the "
                             f"tokenizer it was prepared with or {self.redo}")

    def __repr__(self) -> str:
        return f"PreparedDataset({str(self.path)!r}, train={self.num_tokens('train')} tokens)"


def _read_meta(path: Path | str, redo: str) -> dict[str, Any]:
    file = _child(path, META)
    if isinstance(path, str):
        from forja.data.corpus.remote import has_object, read_meta

        raw = read_meta(path)
        mixture = raw is None and has_object(path, "mixture.json")
    else:
        raw = file.read_bytes() if file.is_file() else None
        mixture = raw is None and (path / "mixture.json").is_file()
    if raw is None:
        hint = ("it is a mixture: open it with forja.data.open_dataset" if mixture
                else "run `forja prepare` to make one (meta.json is written last: without it, a prepared "
                     "directory is incomplete)")
        raise ForjaError(f"{path} is not a prepared data directory (no {META}); {hint}")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise ForjaError(f"{file} is not valid JSON ({exc}); {redo}") from exc
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ForjaError(f"{file} is not forja prepared data of format version {FORMAT_VERSION}; "
                         f"{redo} with this forja")
    return meta


def open_prepared(path: str | os.PathLike[str], tokenizer: Any = None, *,
                  source: str | None = None) -> PreparedDataset:
    """Open a directory written by `forja prepare`; with a tokenizer, check it matches the data.
    `source`: the spec of a cached copy, named in errors instead of its directory."""
    dataset = PreparedDataset(path, source=source)
    if tokenizer is not None:
        dataset.check_tokenizer(tokenizer)
    return dataset
