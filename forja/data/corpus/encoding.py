"""Batched encoding of documents in worker processes, for `prepare`.

The main process reads documents and writes shards; worker processes do everything per
document: encode (one `encode_batch` call per batch of about a megabyte of text), append the
end-of-document token, hash the text (for the validation split and the source fingerprint),
and hand back flat numpy arrays, which pickle as raw bytes instead of millions of Python ints.
Results come back in submission order, so the output does not depend on the number of workers.

This module must stay free of torch: spawned workers import it.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from forja.data.corpus.tokenizer import Tokenizer
from forja.errors import ForjaError

DIGEST_BYTES = 16
_SPLIT_BITS = 64


@dataclass
class Encoded:
    """One batch of documents, encoded."""

    tokens: np.ndarray
    """All documents' token ids back to back, each followed by the end-of-document token."""
    lengths: np.ndarray
    """int64 tokens per document (end-of-document token included)."""
    is_val: np.ndarray
    """bool per document: whether it belongs to the validation split."""
    digests: bytes
    """DIGEST_BYTES of blake2b per document, in order: the source fingerprint is built from them."""
    characters: int
    """Characters in the batch's documents."""


def val_threshold(val_fraction: float) -> int:
    """Documents whose hash (as a 64-bit integer) falls below this go to the validation split."""
    return int(val_fraction * (1 << _SPLIT_BITS))


def encode_documents(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype, threshold: int) -> Encoded:
    """Encode a batch; the split of each document depends on its text alone (stable as a corpus grows)."""
    ids = tokenizer.encode_batch(texts)
    eos = (tokenizer.eos_id,)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = itertools.chain.from_iterable(itertools.chain(x, eos) for x in ids)
    tokens = np.fromiter(flat, dtype=dtype, count=int(lengths.sum()))
    digests = [hashlib.blake2b(t.encode("utf-8"), digest_size=DIGEST_BYTES).digest() for t in texts]
    is_val = np.fromiter((int.from_bytes(d[:8], "little") < threshold for d in digests),
                         dtype=bool, count=len(texts))
    return Encoded(tokens, lengths, is_val, b"".join(digests), sum(map(len, texts)))


def batches(documents: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    """Group documents into batches of about `batch_chars` characters."""
    batch: list[str] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# Per-worker state, set once by the pool initializer: the tokenizer is sent once, not per batch.
_WORKER: dict[str, object] = {}


def _init_worker(tokenizer_json: str, roles: dict[str, str], dtype: str, threshold: int) -> None:
    # Each worker is one core's worth of encoding; the tokenizer's own thread pool would
    # oversubscribe the cores the other workers use.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json, roles), dtype=np.dtype(dtype), threshold=threshold)


def _encode_in_worker(texts: list[str]) -> Encoded:
    return encode_documents(_WORKER["tokenizer"], texts, _WORKER["dtype"], _WORKER["threshold"])  # type: ignore[arg-type]


class EncoderPool:
    """Encodes batches in order with `workers` processes (in this process when workers <= 1)."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, threshold: int, workers: int):
        self.tokenizer, self.dtype, self.threshold, self.workers = tokenizer, dtype, threshold, workers
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> EncoderPool:
        if self.workers > 1:
            # spawn, not fork: the caller may hold threads (torch, the tokenizer's pool) that a
            # forked child would inherit in an unknown state. An executor, not a Pool: a worker
            # that dies breaks it with an error instead of leaving a result to wait for forever.
            args = (self.tokenizer.to_str(), self.tokenizer.roles, self.dtype.str, self.threshold)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=args)
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)
            self._pool = None

    def map(self, batches_in: Iterable[list[str]]) -> Iterator[Encoded]:
        """Encoded batches, in input order, with at most two batches per worker in flight."""
        if self._pool is None:
            for texts in batches_in:
                yield encode_documents(self.tokenizer, texts, self.dtype, self.threshold)
            return
        pending: deque[Future[Encoded]] = deque()
        try:
            for texts in batches_in:
                pending.append(self._pool.submit(_encode_in_worker, texts))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as exc:
            raise ForjaError("a tokenizer worker process died (out of memory, or a script that calls "
                             "prepare without an `if __name__ == '__main__':` guard); fix that, or "
                             "pass workers=1 to encode in this process") from exc
