"""What Llama, Qwen3 and DeepSeek-V3 share beyond the transformer itself: RMSNorm,
rotary positions, a SwiGLU or mixture-of-experts feed-forward, and Llama's initialization.

A family subclasses `RotaryDecoder` and redefines what differs from Llama's grouped-query
attention (`build_attention`) and rotary frequencies (`rope_frequencies`); which blocks hold
a mixture of experts is the args' `is_moe_layer` (MoEArgs; dense families' args are not
MoEArgs), and `experts_only` checks the args of a family whose every block does. Args with
Gated DeltaNet blocks (GatedDeltaNetArgs) get their initialization and FLOPs here too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from forja import fallbacks
from forja.errors import ForjaError
from forja.models.common.attention import Attention
from forja.models.common.blocks import TransformerBlock
from forja.models.common.gated_deltanet import GatedDeltaNetArgs
from forja.models.common.mlp import SwiGLU
from forja.models.common.moe import MoE, MoEArgs
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import rope_cos_sin, rope_frequencies
from forja.models.common.transformer import ATTENTION_TYPES, Transformer, TransformerArgs
from forja.ops.dispatch import ops_mode

# Parameters that write into the residual stream, whose initialization shrinks with depth.
RESIDUAL_OUT = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")


def llama_weight_rule(args, name: str, residual_out: tuple[str, ...] = RESIDUAL_OUT) -> tuple:
    """Llama's init of a weight that is not a norm or a bias: the embedding N(0, 1) (0.02 when
    tied to the output), the output trunc-normal with std 1/sqrt(dim), the projections writing
    to the residual (`residual_out`) shrunk by sqrt(2 x layers), every other 0.02."""
    if name == "tok_embeddings.weight":
        return ("normal", 0.02 if args.tie_embeddings else 1.0)
    if name == "output.weight":
        return ("trunc_normal", args.dim**-0.5)
    if name.endswith(residual_out):
        return ("trunc_normal", 0.02 / math.sqrt(2 * args.n_layers))
    return ("trunc_normal", 0.02)


def experts_only(args: MoEArgs, family: str, dense_hint: str = "") -> None:
    """Checks the args of a family whose every feed-forward is a mixture of experts (Mixtral,
    gpt-oss): `ffn_dim` (Hugging Face's intermediate_size) is one expert's hidden width, which
    `moe_ffn_dim` follows; a second width or no experts is refused, `dense_hint` saying where
    a dense model lives."""
    if args.moe_ffn_dim == 0:
        args.moe_ffn_dim = args.ffn_dim
    if args.moe_ffn_dim != args.ffn_dim:
        raise ForjaError(f"model.moe_ffn_dim={args.moe_ffn_dim} differs from model.ffn_dim={args.ffn_dim}, "
                         f"but a {family}'s experts are its only feed-forward; set ffn_dim alone")
    if args.n_experts < 1:
        raise ForjaError(f"model.n_experts={args.n_experts}: every {family} block is a mixture of experts; "
                         f"set n_experts >= 1{dense_hint}")


class RotaryDecoder(Transformer):
    """Pre-norm RMSNorm blocks with rotary attention and a SwiGLU or MoE feed-forward."""

    def __init__(self, args: TransformerArgs):
        super().__init__(args)
        # Not a buffer: it must stay float32 when the model is cast to bf16, and it is
        # derived from args, so checkpoints need not carry it. Cached per device.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    # -- what a family may redefine --------------------------------------------------------
    def build_attention(self, layer: int) -> nn.Module:
        """Block `layer`'s sequence mixer; by default grouped-query attention (`gqa_attention`)."""
        return self.gqa_attention()

    def rope_frequencies(self) -> torch.Tensor:
        """Inverse frequencies (rotary width // 2,), float32; by default over the whole head, from
        the args' rope_theta and rope_scaling."""
        a = self.args
        return rope_frequencies(a.head_dim, a.rope_theta, a.rope_scaling)

    def rope_scale(self) -> float:
        """A factor on cos and sin (YaRN's attention temperature, from the args' rope_scaling); 1 otherwise."""
        scaling = getattr(self.args, "rope_scaling", None)  # OLMo-Hybrid's args have none
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

    def gqa_attention(self, *, value_embedding: bool = False) -> Attention:
        """Grouped-query attention with the args' heads, QK-norm and fused RoPE settings
        (`value_embedding`: it mixes a value embedding into its values, Attention's docstring)."""
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                         fused_rope="rope" in a.fused_ops, sinks=a.attention_sinks, value_embedding=value_embedding)

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
        return llama_weight_rule(self.args, name)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        if kind == "linear_attention" and isinstance(self.args, GatedDeltaNetArgs):
            return self.args.linear_attention_flops(seq_len)
        return super().mixer_flops(kind, seq_len)


class LocalRopeDecoder(RotaryDecoder):
    """A RotaryDecoder whose sliding blocks rotate with a base of their own (the args'
    `local_rope_theta`), unscaled, and whose full blocks with the model's frequencies and
    scale (`rope_frequencies`, `rope_scale`): Gemma 3's local and global blocks, OLMo 3's."""

    def __init__(self, args: TransformerArgs):
        super().__init__(args)
        self._freqs: dict[tuple[str, torch.device], torch.Tensor] = {}  # (kind, device) -> inv_freq

    def rope_tables_for(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if kind not in ATTENTION_TYPES:
            return None
        full, key = kind == "full_attention", (kind, positions.device)
        if key not in self._freqs:
            a = self.args
            freqs = self.rope_frequencies() if full else rope_frequencies(a.head_dim, a.local_rope_theta)
            self._freqs[key] = freqs.to(positions.device)
        return rope_cos_sin(self._freqs[key], positions, self.rope_scale() if full else 1.0)
