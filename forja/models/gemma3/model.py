"""Gemma 3's text decoder (Gemma Team, "Gemma 3 Technical Report", 2025, arXiv 2503.19786),
single-device.

What sets it apart from Llama:

- Local and global attention, five sliding-window blocks to one full one (`layer_types`),
  each kind with its own rotary base: 10,000 for the local blocks, 1,000,000 for the
  global ones, whose frequencies the 4B, 12B and 27B models also divide by 8 (linear
  scaling, `rope_linear_factor`).
- Sandwich norms: an RMSNorm before each sublayer and another on its output before the
  residual add (attention_norm, post_attention_norm, ffn_norm, post_ffn_norm).
- Gemma's RMSNorm: the weight is stored as its offset from one, y = x_hat * (1 + w),
  multiplied in float32 (`RMSNorm(zero_centered=True)`), QK-norm per head included.
- GeGLU feed-forward: w2(gelu_tanh(w1 x) * w3 x).
- Input embeddings multiplied by sqrt(dim), the factor rounded to the embedding's dtype
  first (as transformers does: 55.5 rather than 55.43 in bf16 at dim 3072); the tied
  output projection uses the unscaled matrix.
- Attention scores scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5
  (they differ in the 27B: 168 against 128).
- Optional tanh soft-capping of the final logits (`final_logit_softcap`; None in Gemma 3,
  30 in Gemma 2).

Parameter names follow the TP plan (`parallelize.py`): attention.wq/wk/wv/wo,
attention.q_norm/k_norm, feed_forward.w1 (gate)/w3 (up)/w2 (down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forja.errors import ForjaError
from forja.models.common.attention import Attention
from forja.models.common.blocks import SandwichBlock
from forja.models.common.decoder import LocalRopeDecoder
from forja.models.common.mlp import GeGLU
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import RopeScaling, YarnScaling, rope_frequencies, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


def gemma3_layer_types(n_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Every `pattern`-th block (1-based) full attention, the others sliding
    (transformers' `sliding_window_pattern` rule)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers))


@dataclass(kw_only=True)
class Gemma3Args(TransformerArgs):
    """A Gemma 3 text model's shape; the package's FLAVORS hold the published sizes."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, QK-norm included (Hugging Face `rms_norm_eps`)."""
    qk_norm: bool = True
    """Per-head RMSNorm of queries and keys; every Gemma 3 has it."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection, as every released Gemma 3 does."""
    rope_theta: float = 1_000_000.0
    """Base of the global (full-attention) blocks' rotary frequencies."""
    local_rope_theta: float = 10_000.0
    """Base of the local (sliding) blocks' rotary frequencies (`rope_local_base_freq`)."""
    rope_linear_factor: float = 1.0
    """The global blocks' frequencies are divided by this (linear position interpolation;
    8 in the 4B, 12B and 27B models); 1: unscaled."""
    rope_scaling: RopeScaling | YarnScaling | None = None
    """YaRN (the default rope_type here) or Llama 3's scaling of the global blocks' frequencies
    (model.rope_scaling), instead of rope_linear_factor; None: the linear factor alone."""
    query_pre_attn_scalar: int | None = None
    """Attention scores are multiplied by query_pre_attn_scalar ** -0.5; None: head_dim."""
    final_logit_softcap: float | None = None
    """Logits become cap * tanh(logits / cap) (`final_logit_softcapping`); None: not capped."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        super().__post_init__()
        if self.rope_scaling is not None and self.rope_linear_factor != 1.0:
            raise ForjaError(f"model rope_scaling and rope_linear_factor = {self.rope_linear_factor} both scale the "
                             "global blocks' frequencies; set rope_linear_factor = 1.0 with a rope_scaling")
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = self.head_dim
        if self.query_pre_attn_scalar <= 0 or self.rope_linear_factor <= 0:
            raise ForjaError(f"model query_pre_attn_scalar={self.query_pre_attn_scalar} and rope_linear_factor="
                             f"{self.rope_linear_factor} must be positive")
        if self.final_logit_softcap is not None and "cross_entropy" in self.fused_ops:
            raise ForjaError("model.final_logit_softcap is set, but the fused cross-entropy never forms the logits "
                             "to cap; drop cross_entropy from model.fused_ops")


class Gemma3(LocalRopeDecoder):
    """Global blocks: base rope_theta, frequencies / rope_linear_factor or scaled by rope_scaling
    (with YaRN's factor on cos and sin); local blocks: base local_rope_theta, unscaled
    (LocalRopeDecoder)."""

    args: Gemma3Args

    def build_block(self, layer: int) -> SandwichBlock:
        return SandwichBlock(self.build_attention(layer), GeGLU(self.args.dim, self.args.ffn_dim),
                             [self.build_norm() for _ in range(4)])

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps, zero_centered=True)

    def build_attention(self, layer: int) -> Attention:
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                         fused_rope="rope" in a.fused_ops, zero_centered_norm=True,
                         scale=a.query_pre_attn_scalar**-0.5)

    def add_positions(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Not positions: Gemma's sqrt(dim) on the embeddings, rounded to their dtype first."""
        return h * torch.tensor(self.args.dim**0.5, dtype=h.dtype, device=h.device)

    def rope_frequencies(self) -> torch.Tensor:
        a = self.args
        return rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling) / a.rope_linear_factor

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = super().logits(h)
        cap = self.args.final_logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def init_rule(self, name: str) -> tuple:
        """Llama's rule, but every norm's stored offset starts at zero (a scale of one)."""
        if name.endswith("norm.weight"):
            return ("zeros",)
        return super().init_rule(name)
