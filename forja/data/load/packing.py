"""How a split's documents become samples of `seq_len + 1` tokens (`data.packing`).

- `window` (the default): sample i is tokens [i*T, i*T + T] of the split's stream,
  documents back to back; consecutive samples share one token and no token is dropped, but
  nearly every sample starts and ends inside a document.
- `bos`: every sample starts at a document start (as modded-nanogpt and nanochat align
  theirs) and runs T + 1 tokens across the documents after it; the next sample starts at the
  first document start at or after its last token, so the tail of the document it ends in is
  dropped. A document longer than `max_doc_tokens` is split into pieces of that many tokens,
  and each piece start counts as a start: long documents are continued, not dropped.
- `best-fit`: documents (pieces of at most `max_doc_tokens`) are placed whole into samples by
  best-fit decreasing within a buffer of `buffer` consecutive pieces; the rest of each sample
  is padding, whose labels are ignored (-100) and whose document id is -1.

Every packing is a pure function of the stream, T and its options: sample i is the same on
every rank and every launch, so the loader's positions resume exactly at any sample. Window
needs no index (and holds no per-document array: a corpus of a billion documents costs it
nothing). bos and best-fit are indexed once per dataset, length and options, into
`$FORJA_CACHE/packing/<key>/` (written whole, then renamed), and memory-mapped: later launches
and the other ranks of a node read the same pages. `rows(indices)` also counts, per sample,
its documents and those it holds only in part, for the metrics (`data/cut_docs`), and
`padding(indices)` its padding (`data/padding`, and the labels the step's loss is over).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forja.data.corpus.shards import TokenStream
from forja.errors import ForjaError
from forja.files import replace_dir

PACKINGS = ("window", "bos", "best-fit")
PAD_DOCUMENT = -1  # the document id of padding: no real token attends to it
IGNORE = -100  # the cross-entropy's ignore_index: padding trains nothing
_INDEX_VERSION = 1


@dataclass
class Rows:
    """Samples as arrays: tokens and document ids (n, T + 1), pieces and cut pieces (n,)."""

    tokens: np.ndarray
    docs: np.ndarray
    pieces: np.ndarray
    cut: np.ndarray


class Packing:
    """Samples of one split at one length; `count` per epoch."""

    count: int

    def rows(self, indices: np.ndarray) -> Rows:
        raise NotImplementedError

    def padding(self, indices: np.ndarray) -> np.ndarray:
        """Padding tokens of each sample's T + 1 (n,)."""
        return np.zeros(len(indices), dtype=np.int64)


def build_packing(kind: str, stream: TokenStream, seq_len: int, *, max_doc_tokens: int, buffer: int,
                  pad_id: int, cache: Path | None = None) -> Packing:
    """`cache`: the directory for this dataset's split's indexes (None: built in memory)."""
    if kind == "window":
        return WindowPacking(stream, seq_len)
    piece = min(max_doc_tokens or seq_len + 1, seq_len + 1)
    if kind == "bos":
        return BosPacking(stream, seq_len, piece, cache=cache)
    if kind == "best-fit":
        return BestFitPacking(stream, seq_len, piece, max(1, buffer), pad_id, cache=cache)
    raise ForjaError(f"data.packing = {kind!r} is not a packing; use one of {', '.join(PACKINGS)}")


def _spans(stream: TokenStream, starts: np.ndarray, seq_len: int) -> Rows:
    """Rows of T + 1 consecutive stream tokens from each start, and what they cut: a row's first
    document is cut when the token before the row is in it, its last when the token after is."""
    n, width, total = len(starts), seq_len + 1, stream.num_tokens
    tokens = np.empty((n, width), dtype=np.int64)
    docs = np.empty((n, width), dtype=np.int64)
    cut = np.zeros(n, dtype=np.int64)
    for row, start in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
        lo, hi = max(start - 1, 0), min(start + width + 1, total)
        ids = stream.document_ids(lo, hi - lo)  # one token either side where there is one
        inner = ids[start - lo:start - lo + width]
        tokens[row], docs[row] = stream.read(start, width), inner
        before = int(start > 0 and ids[0] == inner[0])
        after = int(start + width < total and ids[-1] == inner[-1])
        cut[row] = 1 if before and after and inner[0] == inner[-1] else before + after  # one document: once
    changes = np.ones(docs.shape, dtype=bool)
    changes[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return Rows(tokens, docs, changes.sum(axis=1), cut)


class WindowPacking(Packing):
    """Consecutive windows of the stream (the default, and forja's original packing)."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.count = (stream.num_tokens - 1) // seq_len

    def rows(self, indices: np.ndarray) -> Rows:
        return _spans(self.stream, np.asarray(indices, dtype=np.int64) * self.seq_len, self.seq_len)


def _piece_starts(bounds: np.ndarray, piece: int) -> np.ndarray:
    """Token positions where a piece begins: each document start, then every `piece` tokens
    inside a document longer than that. (pieces,) int64, increasing."""
    starts, lengths = bounds[:-1], np.diff(bounds)
    per_doc = -(-lengths // piece)  # ceil
    first = np.repeat(starts, per_doc)
    within = np.arange(int(per_doc.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
    return first + within * piece


def cached_index(cache: Path | None, key: dict, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays `build()` makes, kept under `cache`/<hash of key>/ and memory-mapped from there;
    built in memory when `cache` is None. Concurrent builders (every rank of a node) each write
    their own temporary copy; the first rename wins and the others are dropped."""
    if cache is None:
        return build()
    folder = cache / hashlib.sha256(json.dumps({**key, "v": _INDEX_VERSION}, sort_keys=True).encode()).hexdigest()[:24]
    if not (folder / "done").is_file():
        arrays = build()
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array)
        (tmp / "done").write_text(json.dumps(key, sort_keys=True))
        replace_dir(tmp, folder, keep_existing=True)  # another process's copy, there already, wins
    return {p.stem: np.load(p, mmap_mode="r") for p in folder.glob("*.npy")}


class BosPacking(Packing):
    """Samples that start at document (or piece) starts."""

    def __init__(self, stream: TokenStream, seq_len: int, piece: int, *, cache: Path | None = None):
        self.stream, self.seq_len = stream, seq_len
        key = {"packing": "bos", "seq_len": seq_len, "piece": piece}
        self.starts = cached_index(cache, key, lambda: {"starts": self._index(piece)})["starts"]
        self.count = len(self.starts)
        if self.count < 1:
            raise ForjaError(f"no document start of {stream.num_tokens} tokens leaves room for a sample of "
                             f"{seq_len + 1}; lower train.seq_len or add data")

    def _index(self, piece: int) -> np.ndarray:
        """Greedy over the stream: each sample from a start, the next at the first start at or
        after its last token (which it shares as its first input, like window's)."""
        T, N = self.seq_len, self.stream.num_tokens
        piece_starts = _piece_starts(self.stream.document_bounds(), piece)
        following = np.searchsorted(piece_starts, piece_starts + T, side="left")  # (pieces,)
        chosen, j = [], 0
        while j < len(piece_starts) and piece_starts[j] + T + 1 <= N:
            chosen.append(piece_starts[j])
            j = int(following[j])
        return np.asarray(chosen, dtype=np.int64)

    def rows(self, indices: np.ndarray) -> Rows:
        return _spans(self.stream, self.starts[np.asarray(indices, dtype=np.int64)], self.seq_len)


class BestFitPacking(Packing):
    """Whole pieces placed by best-fit decreasing within buffers of consecutive pieces.

    The index is CSR: sample k holds pieces `order[ptr[k]:ptr[k+1]]` of the piece table
    (`piece_start`, lengths from consecutive starts), in the order they were placed; `fill`
    is each sample's real tokens, `piece_cut` whether a piece is part of a longer document.
    A piece's document id is its own index: pieces never merge, even two of one document.
    """

    def __init__(self, stream: TokenStream, seq_len: int, piece: int, buffer: int, pad_id: int, *,
                 cache: Path | None = None):
        self.stream, self.seq_len, self.pad_id = stream, seq_len, pad_id
        key = {"packing": "best-fit", "seq_len": seq_len, "piece": piece, "buffer": buffer}
        index = cached_index(cache, key, lambda: self._index(piece, buffer))
        self.piece_start, self.piece_cut = index["piece_start"], index["piece_cut"]
        self.ptr, self.order, self.fill = index["ptr"], index["order"], index["fill"]
        self.count = len(self.fill)

    def _index(self, piece: int, buffer: int) -> dict[str, np.ndarray]:
        bounds = self.stream.document_bounds()
        starts = _piece_starts(bounds, piece)  # (pieces,)
        lengths = np.diff(np.append(starts, self.stream.num_tokens))  # (pieces,) each <= piece
        doc = np.searchsorted(bounds, starts, side="right") - 1
        capacity = self.seq_len + 1
        order: list[np.ndarray] = []
        sizes: list[int] = []
        fill: list[int] = []
        for lo in range(0, len(lengths), buffer):
            chunk = lengths[lo:lo + buffer]
            for members in _best_fit_decreasing(chunk, capacity):
                order.append(lo + members)
                sizes.append(len(members))
                fill.append(int(chunk[members].sum()))
        return {"piece_start": starts, "piece_cut": (np.diff(bounds)[doc] > lengths).astype(np.uint8),
                "ptr": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                "order": np.concatenate(order).astype(np.int64) if order else np.zeros(0, np.int64),
                "fill": np.asarray(fill, dtype=np.int64)}

    def padding(self, indices: np.ndarray) -> np.ndarray:
        return self.seq_len + 1 - np.asarray(self.fill[np.asarray(indices, dtype=np.int64)], dtype=np.int64)

    def pieces_of(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample k's pieces in placement order: (piece index, first token, length), arrays."""
        members = np.asarray(self.order[int(self.ptr[k]):int(self.ptr[k + 1])])
        starts = np.asarray(self.piece_start[members])
        after = members + 1
        last = len(self.piece_start) - 1
        ends = np.where(after <= last, np.asarray(self.piece_start[np.minimum(after, last)]), self.stream.num_tokens)
        return members, starts, ends - starts

    def rows(self, indices: np.ndarray) -> Rows:
        width = self.seq_len + 1
        n = len(indices)
        tokens = np.full((n, width), self.pad_id, dtype=np.int64)
        docs = np.full((n, width), PAD_DOCUMENT, dtype=np.int64)
        pieces, cut = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for row, k in enumerate(np.asarray(indices, dtype=np.int64).tolist()):
            members, starts, lengths = self.pieces_of(k)
            at = 0
            for p, start, length in zip(members.tolist(), starts.tolist(), lengths.tolist(), strict=True):
                tokens[row, at:at + length] = self.stream.read(start, length)
                docs[row, at:at + length] = p
                at += length
            pieces[row], cut[row] = len(members), int(np.asarray(self.piece_cut[members]).sum())
        return Rows(tokens, docs, pieces, cut)


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Bins (each an array of indices into `lengths`) by best-fit decreasing: the longest
    first, each into the open bin it fills most tightly, a new bin when none has room. Ties
    go to the earlier piece and the earlier bin: deterministic."""
    by_length = np.argsort(-lengths, kind="stable")
    rooms: list[tuple[int, int]] = []  # (room left, bin), sorted
    bins: list[list[int]] = []
    for i in by_length.tolist():
        need = int(lengths[i])
        at = bisect.bisect_left(rooms, (need, -1))
        if at == len(rooms):
            bins.append([i])
            room, b = capacity - need, len(bins) - 1
        else:
            room, b = rooms.pop(at)
            bins[b].append(i)
            room -= need
        if room > 0:
            bisect.insort(rooms, (room, b))
    return [np.asarray(b, dtype=np.int64) for b in bins]
