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

Parameter names follow the TP plan (the dense one of common/tp_plan.py) and Llama's: attention.wq/wk/wv/wo,
attention.q_norm/k_norm, feed_forward.w1/w2/w3, or in an MoE block
feed_forward.router.gate and feed_forward.experts.w1/w2/w3 (E, H, D) / (E, D, H).
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.moe import MoEArgs
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class Qwen3Args(TransformerArgs, MoEArgs):
    """A Qwen3 model's shape; the package's FLAVORS hold the published sizes. `n_experts=0` is dense
    Qwen3; above 0, Qwen3-MoE, whose dense blocks (if any) use `ffn_dim`."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, QK-norm included (Hugging Face `rms_norm_eps`)."""
    qk_norm: bool = True
    """Per-head RMSNorm of queries and keys; every released Qwen3 has it."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | YarnScaling | None = None
    """YaRN (Qwen's long-context rule, the default rope_type here) or Llama 3's frequency scaling
    (model.rope_scaling); None: plain RoPE."""
    decoder_sparse_step: int = 1
    """Every this-many-th block (1-based) is a mixture of experts; 1: all of them."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks (0-based) that stay dense whatever `decoder_sparse_step` says."""

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)  # a list from TOML
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
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


class Qwen3(RotaryDecoder):
    """RotaryDecoder as it stands (its QK-norm a field of the args); which blocks hold experts:
    `Qwen3Args.is_moe_layer`."""

    args: Qwen3Args
