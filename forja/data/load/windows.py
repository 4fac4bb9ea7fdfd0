"""Windows of a split's stream in its natural order: validation batches, and the check that a
split holds a sample at all.

Sample i of a split is tokens [i*T, i*T + T] of its stream (documents back to back), as the
training loader's `window` packing (forja/data/load/packing.py) cuts them; for a mixture, global
position p picks a part by weight (`order.Interleave`). Validation reads them unshuffled and
always windowed, whatever data.packing is, so its loss stays comparable across packings and
stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from forja.data.corpus.mixture import Mixture
from forja.data.corpus.shards import PreparedDataset
from forja.data.load.batch import Batch, DataArg, as_mixture
from forja.data.load.order import Interleave, Permutation, derive_key
from forja.errors import ForjaError


def too_short(dataset: PreparedDataset, split: str, tokens: int, seq_len: int) -> str:
    """Why `split` of `dataset` holds no sample of seq_len + 1 tokens, and what to do."""
    without = "or set train.val_interval = 0 to train without validation"
    if split != "val":
        return (f"the {split} split of {dataset.name} has {tokens} tokens, too few for one sample of "
                f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len or add data")
    if tokens == 0:
        fraction, documents = dataset.meta.get("val_fraction", 0), dataset.meta["source"]["documents"]
        if not fraction:
            why, fix = "it was prepared with a validation fraction of 0", "prepare it with one above 0"
        elif documents == 1:
            why, fix = "its only document went to training", "add documents"
        else:  # prepared by a forja that let a small corpus leave validation empty
            why, fix = f"none of its {documents} documents went to it", dataset.redo
        return f"the validation split of {dataset.name} is empty ({why}); {fix}, {without}"
    return (f"the validation split of {dataset.name} has {tokens} tokens, too few for one sample of "
            f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len, prepare it with a larger validation "
            f"fraction (data.val_fraction), {without}")


class Samples:
    """Global positions of one split of a mixture -> micro-batches."""

    def __init__(self, mixture: Mixture, split: str, seq_len: int):
        if seq_len < 1:
            raise ForjaError(f"seq_len {seq_len} must be a positive number of tokens")
        self.seq_len = seq_len
        self.streams = [d.split(split) for d in mixture.datasets]
        self.counts = [(s.num_tokens - 1) // seq_len for s in self.streams]
        for dataset, stream, count in zip(mixture.datasets, self.streams, self.counts, strict=True):
            if count < 1:
                raise ForjaError(too_short(dataset, split, stream.num_tokens, seq_len))
        # Document ids are made unique across the datasets of a mixture.
        self.doc_base = np.cumsum([0] + [s.num_documents for s in self.streams])
        self.interleave = Interleave(mixture.weights)
        self._perms: dict[tuple[int, int], Permutation] = {}
        self._seed: int | None = None

    @property
    def samples_per_epoch(self) -> int:
        return sum(self.counts)

    def locate(self, positions: np.ndarray, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Global positions -> (dataset, sample index); seed None means unshuffled."""
        dataset, local = self.interleave.locate(positions)
        counts = np.asarray(self.counts, dtype=np.int64)[dataset]
        epoch, index = np.divmod(local, counts)
        if seed is None:
            return dataset, index
        for d, e in sorted(set(zip(dataset.tolist(), epoch.tolist(), strict=True))):
            where = (dataset == d) & (epoch == e)
            index[where] = self._permutation(seed, d, e)(index[where])
        return dataset, index

    def _permutation(self, seed: int, dataset: int, epoch: int) -> Permutation:
        if self._seed != seed or len(self._perms) > 64:
            self._perms, self._seed = {}, seed
        key = (dataset, epoch)
        if key not in self._perms:
            self._perms[key] = Permutation(self.counts[dataset], derive_key("forja", seed, dataset, epoch))
        return self._perms[key]

    def batch(self, positions: np.ndarray, seed: int | None) -> Batch:
        datasets, indices = self.locate(positions, seed)
        T = self.seq_len
        tokens = np.empty((len(positions), T + 1), dtype=np.int64)
        docs = np.empty((len(positions), T), dtype=np.int64)
        for row, (d, i) in enumerate(zip(datasets.tolist(), indices.tolist(), strict=True)):
            stream = self.streams[d]
            tokens[row] = stream.read(i * T, T + 1)
            docs[row] = stream.document_ids(i * T, T) + self.doc_base[d]
        t = torch.from_numpy(tokens)
        # Contiguous copies: losses call .view(-1) on labels, which a strided slice refuses.
        return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.from_numpy(docs))  # (m, T) each


class ValidationLoader:
    """A fixed number of unshuffled micro-batches of a split, sharded by rank; no state.

    Batch b on rank r holds global positions [(b*w + r)*m, (b*w + r + 1)*m) in the split's
    natural order (positions past the end wrap around), so every pass sees the same samples.
    """

    def __init__(self, data: DataArg, *, seq_len: int, micro_batch_size: int, num_batches: int,
                 dp_rank: int = 0, dp_world_size: int = 1, split: str = "val", tokenizer: Any = None):
        if num_batches < 1 or micro_batch_size < 1:
            raise ForjaError(f"validation needs num_batches ({num_batches}) and micro_batch_size "
                             f"({micro_batch_size}) of at least 1")
        if not 0 <= dp_rank < dp_world_size:
            raise ForjaError(f"data-parallel rank {dp_rank} is outside world size {dp_world_size}")
        self.samples = Samples(as_mixture(data, tokenizer), split, seq_len)
        self.micro_batch_size, self.num_batches = micro_batch_size, num_batches
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        m = self.micro_batch_size
        for b in range(self.num_batches):
            first = (b * self.dp_world_size + self.dp_rank) * m
            yield self.samples.batch(np.arange(first, first + m), seed=None)

