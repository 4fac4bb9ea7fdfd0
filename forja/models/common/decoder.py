"""What Llama, Qwen3 and DeepSeek-V3 share beyond the transformer itself: RMSNorm,
rotary positions, a SwiGLU or mixture-of-experts feed-forward, and Llama's initialization.

A family subclasses `RotaryDecoder` and defines its attention (`build_attention`) and its
rotary frequencies (`rope_frequencies`); which blocks hold a mixture of experts is the
args' `is_moe_layer` (MoEArgs; dense families' args are not MoEArgs). Args with Gated
DeltaNet blocks (GatedDeltaNetArgs) get their initialization and FLOPs here too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from forja import fallbacks
from forja.models.common.attention import Attention
from forja.models.common.blocks import TransformerBlock
from forja.models.common.gated_deltanet import GatedDeltaNetArgs
from forja.models.common.mlp import SwiGLU
from forja.models.common.moe import MoE, MoEArgs
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import rope_cos_sin
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.ops.dispatch import ops_mode

# Parameters that write into the residual stream, whose initialization shrinks with depth.
RESIDUAL_OUT = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")


class RotaryDecoder(Transformer):
    """Pre-norm RMSNorm blocks with rotary attention and a SwiGLU or MoE feed-forward."""

    def __init__(self, args: TransformerArgs):
        super().__init__(args)
        # Not a buffer: it must stay float32 when the model is cast to bf16, and it is
        # derived from args, so checkpoints need not carry it. Cached per device.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    # -- what a family defines -------------------------------------------------------------
    def build_attention(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def rope_frequencies(self) -> torch.Tensor:
        """Inverse frequencies (rotary width // 2,), float32."""
        raise NotImplementedError

    def rope_scale(self) -> float:
        """A factor on cos and sin (YaRN's attention temperature, from the args' rope_scaling); 1 otherwise."""
        scaling = getattr(self.args, "rope_scaling", None)
        return 1.0 if scaling is None else scaling.rope_scale()

    # -- shared ------------------------------------------------------------------------------
    def build_block(self, layer: int) -> TransformerBlock:
        return TransformerBlock(self.build_attention(layer), self.build_feed_forward(layer),
                                self.build_norm(), self.build_norm())

    def build_feed_forward(self, layer: int) -> nn.Module:
        a = self.args
        fused = "swiglu" in a.fused_ops
        if isinstance(a, MoEArgs) and a.is_moe_layer(layer):
            if fused and (torch.cuda.is_available() or ops_mode() == "triton"):  # where the kernel is promised
                fallbacks.record("ops.swiglu.experts", asked="model.fused_ops (swiglu)",
                                 instead="silu(gate) * up unfused in the routed experts",
                                 why="the grouped experts compute their activation in PyTorch; only the shared "
                                 "experts take the fused op")
            return MoE(a.dim, a, fused_swiglu=fused)
        return SwiGLU(a.dim, a.ffn_dim, fused=fused)

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps, fused="rms_norm" in self.args.fused_ops)

    def gqa_attention(self) -> Attention:
        """Grouped-query attention with the args' heads, QK-norm and fused RoPE settings."""
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                         fused_rope="rope" in a.fused_ops, sinks=a.attention_sinks)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self.rope_frequencies().to(device)
        return rope_cos_sin(self._inv_freq[device], positions, self.rope_scale())

    def init_rule(self, name: str) -> tuple:
        """Small-std truncated normals; the matrices that write into the residual stream (wo,
        the MLP's and every expert's w2) shrink with depth so the stream's variance stays
        bounded. Routers, experts' w1/w3 and attention projections: std 0.02. A Gated DeltaNet's
        own parameters: `gated_deltanet_init_rule`."""
        if isinstance(self.args, GatedDeltaNetArgs) and (rule := self.args.linear_init_rule(name)) is not None:
            return rule
        if name.endswith("norm.weight"):
            return ("ones",)
        if name.endswith("attention.sinks"):
            return ("zeros",)
        if name == "tok_embeddings.weight":
            return ("normal", 0.02 if self.args.tie_embeddings else 1.0)
        if name == "output.weight":
            return ("trunc_normal", self.args.dim**-0.5)
        if name.endswith(RESIDUAL_OUT):
            return ("trunc_normal", 0.02 / math.sqrt(2 * self.args.n_layers))
        return ("trunc_normal", 0.02)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        if kind == "linear_attention" and isinstance(self.args, GatedDeltaNetArgs):
            return self.args.linear_attention_flops(seq_len)
        return super().mixer_flops(kind, seq_len)
