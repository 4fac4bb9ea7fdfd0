"""The data pipeline: sources -> tokenizer -> prepared shards -> a resumable loader (docs/data.md).

Its floors, lowest first; each imports only those below it (tests/unit/test_layering.py):

    config.py   [data], read by both sides
    corpus/     preparation, torch-free: sources, the tokenizer, shards, mixtures, `forja prepare`
    load/       the loader (torch): order, packing, stages, batches, validation windows

This file holds the public names. The loader's are imported lazily (PEP 562): `forja prepare`'s
worker processes import this package and must not pay for torch, which only the loader needs.
"""

from __future__ import annotations

import importlib
from typing import Any

from forja.data.corpus.mixture import Mixture
from forja.data.corpus.prepare import cache_key, open_dataset, prepare, prepare_cached
from forja.data.corpus.shards import PreparedDataset, open_prepared
from forja.data.corpus.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

_LAZY = {
    "DataLoader": "forja.data.load.loader",
    "ValidationLoader": "forja.data.load.windows",
    "Batch": "forja.data.load.batch",
    "DataConfig": "forja.data.config",
}

__all__ = [
    "Batch", "DataConfig", "DataLoader", "Mixture", "PreparedDataset", "Tokenizer", "ValidationLoader",
    "cache_key", "load_tokenizer", "open_dataset", "open_prepared", "prepare", "prepare_cached",
    "train_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'forja.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return __all__
