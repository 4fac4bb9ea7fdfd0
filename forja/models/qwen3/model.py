"""Qwen3 (Qwen team, "Qwen3 Technical Report", 2025), dense and mixture-of-experts, single-device.

A Llama-shaped decoder: RMSNorm pre-norm blocks, grouped-query attention with plain
rotary positions (base 1e6), SwiGLU feed-forward. What sets it apart:

- QK-norm: an RMSNorm over each head's query and key (after the split into heads, before
  RoPE), with the model's eps; it replaces Qwen2's q/k/v biases.
- An explicit head width (128 at every size): 0.6B has dim 1024 and 16 heads, so
  n_heads * head_dim != dim and wq is (2048, 1024).
- Qwen3-MoE: some blocks swap the dense MLP for a routed mixture of experts (softmax
  router, top-k, probabilities renormalized over the chosen k; no shared expert). Which
  blocks: `Qwen3Args.is_moe_layer`, Hugging Face's `decoder_sparse_step` and
  `mlp_only_layers` rule.

Parameter names follow the TP plan (`parallelize.py`) and Llama's: attention.wq/wk/wv/wo,
attention.q_norm/k_norm, feed_forward.w1/w2/w3, or in an MoE block
feed_forward.router.gate and feed_forward.experts.w1/w2/w3 (E, H, D) / (E, D, H).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import Attention
from forja.models.common.mlp import SwiGLU
from forja.models.common.moe import MoE, MoEArgs
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import rope_cos_sin, rope_frequencies
from forja.models.common.transformer import Transformer, TransformerArgs, TransformerBlock


@dataclass(kw_only=True)
class Qwen3Args(TransformerArgs, MoEArgs):
    """A Qwen3 model's shape; `flavors.py` holds the published sizes. `n_experts=0` is dense
    Qwen3; above 0, Qwen3-MoE, whose dense blocks (if any) use `ffn_dim`."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, QK-norm included (Hugging Face `rms_norm_eps`)."""
    qk_norm: bool = True
    """Per-head RMSNorm of queries and keys; every released Qwen3 has it."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary frequencies."""
    decoder_sparse_step: int = 1
    """Every this-many-th block (1-based) is a mixture of experts; 1: all of them."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks (0-based) that stay dense whatever `decoder_sparse_step` says."""

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)  # a list from TOML
        super().__post_init__()
        self.check_moe()
        if self.decoder_sparse_step < 1:
            raise ForjaError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be at least 1")
        if self.n_experts > 0 and not any(self.is_moe_layer(i) for i in range(self.n_layers)):
            raise ForjaError(f"model.n_experts={self.n_experts} but no block is a mixture of experts "
                             f"(decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                             f"{list(self.mlp_only_layers)}); set n_experts=0 for a dense model")

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


# Parameters that write into the residual stream, whose init shrinks with depth.
_RESIDUAL_OUT = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")


class Qwen3(Transformer):
    args: Qwen3Args

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        # Not a buffer: it must stay float32 when the model is cast to bf16, and it is
        # derived from args, so checkpoints need not carry it. Cached per device.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def build_block(self, layer: int) -> TransformerBlock:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                              fused_rope="rope" in a.fused_ops)
        fused_swiglu = "swiglu" in a.fused_ops
        if a.is_moe_layer(layer):
            ffn: nn.Module = MoE(a.dim, a, fused_swiglu=fused_swiglu)
        else:
            ffn = SwiGLU(a.dim, a.ffn_dim, fused=fused_swiglu)
        return TransformerBlock(attention, ffn, self.build_norm(), self.build_norm())

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps, fused="rms_norm" in self.args.fused_ops)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_frequencies(self.args.head_dim, self.args.rope_theta).to(device)
        return rope_cos_sin(self._inv_freq[device], positions)

    def init_rule(self, name: str) -> tuple:
        """Llama's scheme: small-std truncated normals, depth-scaled for the matrices that
        write into the residual stream (wo, the MLP's and every expert's w2)."""
        if name.endswith("norm.weight"):
            return ("ones",)
        if name == "tok_embeddings.weight":
            return ("normal", 0.02 if self.args.tie_embeddings else 1.0)
        if name == "output.weight":
            return ("trunc_normal", self.args.dim**-0.5)
        if name.endswith(_RESIDUAL_OUT):
            return ("trunc_normal", 0.02 / math.sqrt(2 * self.args.n_layers))
        return ("trunc_normal", 0.02)  # wq/wk/wv, w1/w3, experts.w1/w3, router.gate.weight
