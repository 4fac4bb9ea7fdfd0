"""The [model] section of a config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train."""

    family: str = "llama"
    """Model family: llama or gpt2."""
    flavor: str = "debug"
    """A size from the family's flavors.py (debug, tiny, 3.2-1b, 124m, ...)."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: sdpa, or flex (FlexAttention with a document block mask, CUDA)."""
    document_mask: bool = True
    """Keep attention within each document of a packed sequence."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of the flavor to change, e.g. {n_layers = 2, qk_norm = true}."""
    init_from: str | None = None
    """Start from these weights instead of random ones: a Hugging Face directory, or a forja
    run directory or checkpoint (weights only; the optimizer and data start afresh)."""
