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

Every packing is a pure function of the stream, T and its options, indexed once when first
used: sample i is the same on every rank and every launch, so the loader's positions resume
exactly at any sample. `stats(indices)` gives the padding and the documents a sample cuts,
for the metrics (`data/padding`, `data/cut_docs`), and `valid(indices)` the labels a sample
trains on (what the step's loss is normalized by when there is padding).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from forja.data.shards import TokenStream
from forja.errors import ForjaError

PACKINGS = ("window", "bos", "best-fit")
PAD_DOCUMENT = -1  # the document id of padding: no real token attends to it
IGNORE = -100  # the cross-entropy's ignore_index: padding trains nothing


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
    num_ids: int  # document ids used are [0, num_ids), then PAD_DOCUMENT

    def rows(self, indices: np.ndarray) -> Rows:
        raise NotImplementedError

    def padding(self, indices: np.ndarray) -> np.ndarray:
        """Padding tokens of each sample's T + 1 (n,)."""
        return np.zeros(len(indices), dtype=np.int64)


def build_packing(kind: str, stream: TokenStream, seq_len: int, *, max_doc_tokens: int, buffer: int,
                  pad_id: int) -> Packing:
    if kind == "window":
        return WindowPacking(stream, seq_len)
    piece = min(max_doc_tokens or seq_len + 1, seq_len + 1)
    if kind == "bos":
        return BosPacking(stream, seq_len, piece)
    if kind == "best-fit":
        return BestFitPacking(stream, seq_len, piece, buffer, pad_id)
    raise ForjaError(f"data.packing = {kind!r} is not a packing; use one of {', '.join(PACKINGS)}")


def _cut_pieces(docs: np.ndarray, starts: np.ndarray, ends: np.ndarray, lo: np.ndarray,
                hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: distinct documents among its tokens, and how many of them the row holds only in
    part (a document's first token before `lo` or its last at or past `hi`)."""
    changes = np.ones(docs.shape, dtype=bool)
    changes[:, 1:] = docs[:, 1:] != docs[:, :-1]
    pieces = changes.sum(axis=1)
    first, last = docs[:, 0], docs[:, -1]
    cut = (starts[first] < lo).astype(np.int64) + (ends[last] > hi)
    cut -= (first == last) & (cut == 2)  # one document cut at both ends counts once
    return pieces, cut


class WindowPacking(Packing):
    """Consecutive windows of the stream (the default, and forja's original packing)."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.count = (stream.num_tokens - 1) // seq_len
        self.num_ids = stream.num_documents
        self._bounds = stream.document_bounds()  # (documents + 1,) token positions

    def rows(self, indices: np.ndarray) -> Rows:
        T = self.seq_len
        tokens = np.stack([self.stream.read(int(i) * T, T + 1) for i in indices]).astype(np.int64)
        docs = np.stack([self.stream.document_ids(int(i) * T, T + 1) for i in indices]).astype(np.int64)
        lo = np.asarray(indices, dtype=np.int64) * T
        pieces, cut = _cut_pieces(docs, self._bounds[:-1], self._bounds[1:], lo, lo + T + 1)
        return Rows(tokens, docs, pieces, cut)


def _piece_starts(bounds: np.ndarray, piece: int) -> np.ndarray:
    """Token positions where a piece begins: each document start, then every `piece` tokens
    inside a document longer than that. (pieces,) int64, increasing."""
    starts, lengths = bounds[:-1], np.diff(bounds)
    per_doc = -(-lengths // piece)  # ceil
    first = np.repeat(starts, per_doc)
    within = np.arange(int(per_doc.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
    return first + within * piece


class BosPacking(Packing):
    """Samples that start at document (or piece) starts."""

    def __init__(self, stream: TokenStream, seq_len: int, piece: int):
        self.stream, self.seq_len = stream, seq_len
        self.num_ids = stream.num_documents
        self._bounds = stream.document_bounds()
        self.starts = self._index(_piece_starts(self._bounds, piece))
        self.count = len(self.starts)
        if self.count < 1:
            raise ForjaError(f"no document start of {stream.num_tokens} tokens leaves room for a sample of "
                             f"{seq_len + 1}; lower train.seq_len or add data")

    def _index(self, piece_starts: np.ndarray) -> np.ndarray:
        """Greedy over the stream: each sample from a start, the next at the first start at or
        after its last token (which it shares as its first input, like window's)."""
        T, N = self.seq_len, self.stream.num_tokens
        following = np.searchsorted(piece_starts, piece_starts + T, side="left")  # (pieces,)
        chosen, j = [], 0
        while j < len(piece_starts) and piece_starts[j] + T + 1 <= N:
            chosen.append(piece_starts[j])
            j = int(following[j])
        return np.asarray(chosen, dtype=np.int64)

    def rows(self, indices: np.ndarray) -> Rows:
        T = self.seq_len
        lo = self.starts[np.asarray(indices, dtype=np.int64)]
        tokens = np.stack([self.stream.read(int(s), T + 1) for s in lo]).astype(np.int64)
        docs = np.stack([self.stream.document_ids(int(s), T + 1) for s in lo]).astype(np.int64)
        pieces, cut = _cut_pieces(docs, self._bounds[:-1], self._bounds[1:], lo, lo + T + 1)
        return Rows(tokens, docs, pieces, cut)


class BestFitPacking(Packing):
    """Whole pieces placed by best-fit decreasing within buffers of consecutive pieces.

    The index is CSR: sample k holds pieces `order[ptr[k]:ptr[k+1]]` of the piece table
    (start, length, id), in the order they were placed.
    """

    def __init__(self, stream: TokenStream, seq_len: int, piece: int, buffer: int, pad_id: int):
        self.stream, self.seq_len, self.pad_id = stream, seq_len, pad_id
        bounds = stream.document_bounds()
        self.piece_start = _piece_starts(bounds, piece)  # (pieces,)
        ends = np.append(self.piece_start[1:], stream.num_tokens)
        self.piece_len = ends - self.piece_start  # (pieces,) each <= piece
        # A piece is cut when its document is longer than one piece.
        self.piece_doc = np.searchsorted(bounds, self.piece_start, side="right") - 1
        doc_len = np.diff(bounds)[self.piece_doc]
        self.piece_cut = doc_len > self.piece_len
        self.num_ids = len(self.piece_start)  # each piece its own document id: pieces never merge
        self.ptr, self.order, self.fill = self._index(max(1, buffer))
        self.count = len(self.fill)

    def _index(self, buffer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        capacity = self.seq_len + 1
        order: list[int] = []
        ptr, fill = [0], []
        for lo in range(0, len(self.piece_len), buffer):
            lengths = self.piece_len[lo:lo + buffer]
            bins = _best_fit_decreasing(lengths, capacity)
            for members in bins:
                order.extend(lo + m for m in members)
                ptr.append(len(order))
                fill.append(int(lengths[members].sum()))
        return np.asarray(ptr, dtype=np.int64), np.asarray(order, dtype=np.int64), np.asarray(fill, dtype=np.int64)

    def padding(self, indices: np.ndarray) -> np.ndarray:
        return self.seq_len + 1 - self.fill[np.asarray(indices, dtype=np.int64)]

    def rows(self, indices: np.ndarray) -> Rows:
        width = self.seq_len + 1
        n = len(indices)
        tokens = np.full((n, width), self.pad_id, dtype=np.int64)
        docs = np.full((n, width), PAD_DOCUMENT, dtype=np.int64)
        pieces, cut = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for row, k in enumerate(np.asarray(indices, dtype=np.int64).tolist()):
            at = 0
            members = self.order[self.ptr[k]:self.ptr[k + 1]]
            for p in members.tolist():
                length = int(self.piece_len[p])
                tokens[row, at:at + length] = self.stream.read(int(self.piece_start[p]), length)
                docs[row, at:at + length] = p
                at += length
            pieces[row], cut[row] = len(members), int(self.piece_cut[members].sum())
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
