"""Llama 3 (Meta, "The Llama 3 Herd of Models", 2024), single-device.

RMSNorm pre-norm blocks, grouped-query attention with rotary positions (with the
Llama 3.1 long-context frequency scaling), SwiGLU feed-forward, untied or tied
(Llama 3.2 1B/3B) embeddings, optional QK-norm. Parameter names follow
`parallelize.py`'s tensor-parallel plan: attention.wq/wk/wv/wo, feed_forward.w1/w2/w3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from forja.models.common.attention import Attention
from forja.models.common.mlp import SwiGLU
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import RopeScaling, rope_cos_sin, rope_frequencies
from forja.models.common.transformer import Transformer, TransformerArgs, TransformerBlock


@dataclass(kw_only=True)
class LlamaArgs(TransformerArgs):
    """A Llama model's shape; `flavors.py` holds the published sizes."""

    rope_theta: float = 500_000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling; None for plain RoPE."""

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from TOML or a flavor override
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        super().__post_init__()


class Llama(Transformer):
    args: LlamaArgs

    def __init__(self, args: LlamaArgs):
        super().__init__(args)
        # Not a buffer: it must stay float32 when the model is cast to bf16, and it is
        # derived from args, so checkpoints need not carry it. Cached per device.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def build_block(self, layer: int) -> TransformerBlock:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                              fused_rope="rope" in a.fused_ops)
        return TransformerBlock(attention, SwiGLU(a.dim, a.ffn_dim, fused="swiglu" in a.fused_ops),
                                self.build_norm(), self.build_norm())

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps, fused="rms_norm" in self.args.fused_ops)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions.device
        if device not in self._inv_freq:
            a = self.args
            self._inv_freq[device] = rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling).to(device)
        return rope_cos_sin(self._inv_freq[device], positions)

    def init_rule(self, name: str) -> tuple:
        """Small-std truncated normals; the matrices that write into the residual stream
        (wo, w2) shrink with depth so the stream's variance stays bounded."""
        if name.endswith("norm.weight"):
            return ("ones",)
        if name == "tok_embeddings.weight":
            return ("normal", 0.02 if self.args.tie_embeddings else 1.0)
        if name == "output.weight":
            return ("trunc_normal", self.args.dim**-0.5)
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return ("trunc_normal", 0.02 / math.sqrt(2 * self.args.n_layers))
        return ("trunc_normal", 0.02)
