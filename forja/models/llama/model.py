"""Llama 3 (Meta, "The Llama 3 Herd of Models", 2024), single-device.

RMSNorm pre-norm blocks, grouped-query attention with rotary positions (with the
Llama 3.1 long-context frequency scaling), SwiGLU feed-forward, untied or tied
(Llama 3.2 1B/3B) embeddings, optional QK-norm. Parameter names follow
the dense tensor-parallel plan's (common/tp_plan.py): attention.wq/wk/wv/wo, feed_forward.w1/w2/w3.
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.models.common.decoder import RotaryDecoder
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class LlamaArgs(TransformerArgs):
    """A Llama model's shape; the package's FLAVORS hold the published sizes."""

    rope_theta: float = 500_000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | YarnScaling | None = None
    """Llama 3.1's frequency scaling or YaRN (model.rope_scaling, a table whose rope_type is "llama3",
    the default here, or "yarn"); None for plain RoPE."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="llama3")
        super().__post_init__()


class Llama(RotaryDecoder):
    """RotaryDecoder as it stands: grouped-query attention, whole-head RoPE, SwiGLU."""

    args: LlamaArgs
