"""A micro-batch, and the data arguments the loaders take (a dataset, a mixture, a path or a
source spec, or (data, weight) pairs)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from forja.data.corpus.mixture import Mixture
from forja.data.corpus.prepare import open_dataset
from forja.data.corpus.shards import PreparedDataset
from forja.errors import ForjaError


@dataclass
class Batch:
    """One micro-batch: (m, T) int64 tensors, and what the step's loss and metrics need."""

    input_ids: torch.Tensor
    """Token ids, (m, T)."""
    labels: torch.Tensor
    """The next token of each position, (m, T); -100 (ignored) where it is padding."""
    document_ids: torch.Tensor
    """Per-token document id, (m, T): equal ids are one document (attention stays within); -1 is padding."""
    step_labels: int = 0
    """Labels trained on in the whole global batch of the step (0: every position's, no padding)."""
    documents: int = 0
    """Documents (or pieces) the micro-batch's samples hold, counted once per sample."""
    cut_documents: int = 0
    """Of those, the ones a sample holds only in part."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def _with(self, tensors: Any) -> Batch:
        return Batch(*tensors, step_labels=self.step_labels, documents=self.documents,
                     cut_documents=self.cut_documents)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._with(t.to(device, non_blocking=non_blocking)
                          for t in (self.input_ids, self.labels, self.document_ids))

    def pinned(self) -> Batch:
        return self._with(t.pin_memory() for t in (self.input_ids, self.labels, self.document_ids))


DataArg = PreparedDataset | Mixture | str | os.PathLike[str] | Sequence[tuple[Any, float]]


def as_mixture(data: DataArg, tokenizer: Any = None) -> Mixture:
    """A Mixture from a dataset, a Mixture, a path or source spec, or (data, weight) pairs."""
    if isinstance(data, (str, os.PathLike)):
        mixture = Mixture.of(open_dataset(data, tokenizer))
    elif isinstance(data, (PreparedDataset, Mixture)):
        mixture = Mixture.of(data)
    else:
        mixture = Mixture.of([(_single(d, tokenizer), w) for d, w in data])
    if tokenizer is not None:
        mixture.check_tokenizer(tokenizer)
    return mixture


def _single(data: Any, tokenizer: Any) -> PreparedDataset:
    if isinstance(data, PreparedDataset):
        return data
    datasets = as_mixture(data, tokenizer).datasets
    if len(datasets) != 1:
        raise ForjaError(f"a part of a mixture cannot itself be a mixture ({data}); list its parts instead")
    return datasets[0]
