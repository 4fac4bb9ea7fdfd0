"""The `[data]` section of a training config: which data, and how it is prepared and read.

Batch sizes, sequence length and the sample-order seed live in `[train]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError

# Byte-level BPE starts from the 256 byte symbols; forja adds its 3 special tokens. Here, not in
# tokenizer.py, so that loading a config does not import the tokenizers library.
MIN_VOCAB_SIZE = 256 + 3


@dataclass(kw_only=True)
class DataConfig:
    """Where the training data comes from (see docs/data.md)."""

    path: str = "stdlib"
    """A prepared directory, a mixture directory, or a source spec (prepared on first use, cached in $FORJA_CACHE)."""
    tokenizer: str | None = None
    """tokenizer.json (or a directory holding one); None: the one beside prepared data, or one trained on the source."""
    vocab_size: int = 8192
    """Vocabulary of the tokenizer trained on the source when `tokenizer` is None."""
    val_fraction: float = 0.01
    """Share of documents in the validation split when a source is prepared on first use (one at least, of two)."""
    workers: int = 0
    """Tokenizer processes when preparing on first use; 0 means every core."""
    prefetch: int = 2
    """Optimizer steps of batches a background thread builds ahead; 0 builds each when asked."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ForjaError("data.path is empty; give a prepared directory or a source such as 'stdlib'")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ForjaError(f"data.vocab_size = {self.vocab_size} must be at least {MIN_VOCAB_SIZE}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ForjaError(f"data.val_fraction = {self.val_fraction} must be in [0, 1)")
        for key in ("workers", "prefetch"):
            if getattr(self, key) < 0:
                raise ForjaError(f"data.{key} = {getattr(self, key)} must be 0 or more")
