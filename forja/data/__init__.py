"""The data pipeline: sources -> tokenizer -> prepared shards -> a resumable loader.

See docs/data.md. The loader's names are imported lazily (PEP 562): `prepare`'s worker
processes import this package and must not pay for torch, which only the loader needs.
(`prepare` is imported eagerly because the submodule of the same name would shadow it.)
"""

from __future__ import annotations

import importlib
from typing import Any

from forja.data.mixture import Mixture
from forja.data.prepare import cache_key, open_dataset, prepare, prepare_cached
from forja.data.shards import PreparedDataset, open_prepared
from forja.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

_LAZY = {
    "DataLoader": "forja.data.loader",
    "ValidationLoader": "forja.data.windows",
    "Batch": "forja.data.batch",
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
