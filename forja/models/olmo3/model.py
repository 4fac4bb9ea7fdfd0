"""OLMo 3 (Ai2, "Olmo 3", 2025; OLMo 2: OLMo et al. 2024, arXiv 2501.00656), single-device.

A Llama-sized decoder (RMSNorm, SwiGLU, rotary attention, untied embeddings) with OLMo 2's
changes and OLMo 3's local attention:

- Post-norm blocks: no norm before a sublayer; its output is normalized before it joins
  the residual stream, h = x + post_attention_norm(attn(x)), then
  out = h + post_ffn_norm(mlp(h)) (OLMo 2's "reordered norm"). The final norm stays.
- QK-norm over the whole projections: one RMSNorm over the n_heads * head_dim queries and
  one over the n_kv_heads * head_dim keys, before the split into heads and before RoPE,
  not per head (`Attention(qk_norm_over_heads=True)`).
- Sliding-window attention in three blocks of four (`layer_types`: sliding, sliding,
  sliding, full; window 4096 in the released models).
- RoPE base 500,000; the long-context checkpoints scale the full-attention blocks' rotary
  frequencies with YaRN and leave the sliding blocks' unscaled (transformers 5 reads
  `rope_scaling` into the full-attention layers only), so the two kinds get their own tables.

Parameter names follow the TP plan (`parallelize.py`): attention.wq/wk/wv/wo,
attention.q_norm/k_norm, feed_forward.w1/w2/w3, post_attention_norm, post_ffn_norm.
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.models.common.attention import Attention
from forja.models.common.blocks import PostNormBlock
from forja.models.common.decoder import LocalRopeDecoder
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


def olmo3_layer_types(n_layers: int) -> tuple[str, ...]:
    """Three sliding blocks, then one full, repeated (transformers' Olmo3Config default)."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers))


@dataclass(kw_only=True)
class Olmo3Args(TransformerArgs):
    """An OLMo 3 model's shape; the package's FLAVORS hold the published sizes."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, QK-norm included (Hugging Face `rms_norm_eps`)."""
    qk_norm: bool = True
    """RMSNorm over the whole query and key projections; every OLMo 3 has it."""
    rope_theta: float = 500_000.0
    """Base of the full-attention blocks' rotary frequencies."""
    local_rope_theta: float = 500_000.0
    """Base of the sliding blocks' rotary frequencies (the same in every released model)."""
    rope_scaling: YarnScaling | RopeScaling | None = None
    """YaRN scaling of the full-attention blocks' frequencies; None: plain RoPE."""

    def __post_init__(self) -> None:
        # A table from TOML or a flavor override; YaRN unless its rope_type says "llama3".
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        super().__post_init__()


class Olmo3(LocalRopeDecoder):
    """Full blocks: base rope_theta, YaRN-scaled when configured; sliding blocks: base
    local_rope_theta, unscaled (LocalRopeDecoder)."""

    args: Olmo3Args

    def build_block(self, layer: int) -> PostNormBlock:
        return PostNormBlock(self.build_attention(layer), self.build_feed_forward(layer),
                             self.build_norm(), self.build_norm())

    def build_attention(self, layer: int) -> Attention:
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                         fused_rope="rope" in a.fused_ops, qk_norm_over_heads=True)
