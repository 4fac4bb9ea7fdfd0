"""Qwen3.5 (Qwen team, 2026), dense and mixture-of-experts, single-device: a hybrid of
Gated DeltaNet and gated full attention.

Three of every four blocks mix the sequence with Gated DeltaNet (linear attention with a
gated delta rule, forja/models/common/gated_deltanet.py), whose state has a fixed size
whatever the context; every fourth (`full_attention_interval`) is full softmax attention,
with what sets Qwen3.5's apart from Qwen3's:

- an output gate: each head's output times sigmoid of its own projection of the block's
  input (`attention.wg`; Hugging Face fuses it into q_proj, per head after the query);
- partial RoPE: only the first quarter of each 256-wide head rotates (`partial_rotary_factor`);
- zero-centered RMSNorms (weight stored as the offset from one), QK-norm per head included;
  the Gated DeltaNet's own output norm keeps a plain weight.

Qwen3.5-MoE makes every block's feed-forward a mixture of experts (softmax router, top-k
renormalized) plus one shared expert scaled by a per-token sigmoid gate.

Parameter names: attention.wq/wk/wv/wo/wg and attention.q_norm/k_norm in attention blocks;
attention.wq/wk/wv/wz/wb/wa/wo, conv_q/k/v, A_log, dt_bias, norm in Gated DeltaNet blocks;
feed_forward as in Qwen3 (router.gate, experts.w1/w2/w3, shared_experts.w1/w2/w3, shared_gate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import Attention
from forja.models.common.blocks import TransformerBlock
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.gated_deltanet import GatedDeltaNetArgs
from forja.models.common.moe import MoEArgs
from forja.models.common.mtp import MultiTokenPrediction
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import RopeScaling, YarnScaling, rope_frequencies, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class Qwen3_5Args(GatedDeltaNetArgs, TransformerArgs, MoEArgs):
    """A Qwen3.5 model's shape; the package's FLAVORS hold the published sizes. `n_experts=0` is
    dense Qwen3.5; above 0, Qwen3.5-MoE (every block a mixture of experts)."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (Hugging Face `rms_norm_eps`)."""
    qk_norm: bool = True
    """Per-head RMSNorm of queries and keys in the attention blocks."""
    rope_theta: float = 10_000_000.0
    """Base of the rotary frequencies."""
    partial_rotary_factor: float = 0.25
    """The share of each attention head's width that rotates; the rest carries no position."""
    rope_scaling: RopeScaling | YarnScaling | None = None
    """YaRN (Qwen's long-context rule, the default rope_type here) or Llama 3's frequency scaling of
    the rotating dims (model.rope_scaling); None: plain RoPE."""
    full_attention_interval: int = 4
    """Every this-many-th block (1-based) is full attention, the others Gated DeltaNet; used
    when `layer_types` is empty."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        if not self.layer_types and self.full_attention_interval >= 1:
            interval = self.full_attention_interval
            self.layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                     for i in range(self.n_layers))
        super().__post_init__()
        self.check_moe()
        if self.full_attention_interval < 1:
            raise ForjaError(f"model.full_attention_interval={self.full_attention_interval} must be at least 1")

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# Zero-centered norms start at zero (a scale of one); everything else follows RotaryDecoder.
_ZERO_CENTERED = ("attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight",
                  "attention.k_norm.weight")


class Qwen3_5(RotaryDecoder):
    args: Qwen3_5Args

    def build_attention(self, layer: int) -> nn.Module:
        a = self.args
        if a.layer_type(layer) == "linear_attention":
            return a.gated_deltanet(norm_eps=a.norm_eps)
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                         fused_rope="rope" in a.fused_ops, output_gate=True, rotary_dim=a.rotary_dim,
                         zero_centered_norm=True)

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps, zero_centered=True)

    def rope_frequencies(self) -> torch.Tensor:
        return rope_frequencies(self.args.rotary_dim, self.args.rope_theta, self.args.rope_scaling)

    def build_mtp(self) -> MultiTokenPrediction:
        """The published checkpoints' multi-token prediction module (`mtp_depth` 1; off in the
        flavors): module k's block is full attention, its feed-forward that of block k's
        index in the checkpoint's `mtp.layers` (0), as vLLM, which serves the published
        weights, builds it."""
        a = self.args
        blocks = [TransformerBlock(self.build_attention(a.n_layers + k), self.build_feed_forward(k),
                                   self.build_norm(), self.build_norm()) for k in range(a.mtp_depth)]
        return MultiTokenPrediction(a.dim, blocks, self.build_norm, first=a.n_layers, loss_weight=a.mtp_loss_weight)

    def init_rule(self, name: str) -> tuple:
        if name == "norm.weight" or name.endswith(_ZERO_CENTERED):
            return ("zeros",)
        # The MTP module's own norms (mtp.layers.{j}.hnorm / enorm / norm) are zero-centered too.
        if name.startswith("mtp.layers.") and name.count(".") == 4 and name.endswith("norm.weight"):
            return ("zeros",)
        return super().init_rule(name)

