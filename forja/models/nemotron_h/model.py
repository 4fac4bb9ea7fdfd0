"""Nemotron-H (NVIDIA 2025, "Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer
Models", arXiv 2504.03624), single-device: a stack of one-sublayer residual blocks, each one of

- "mamba2": x + Mamba2(norm(x)) (forja/models/common/mamba2.py), most of the blocks;
- "full_attention": x + Attention(norm(x)), grouped-query attention without positions (NoPE:
  the Mamba-2 blocks carry order) and without biases;
- "mlp": x + W2 relu(W1 norm(x))^2, a squared-ReLU MLP without a gate;
- "moe": x + MoE(norm(x)), Nemotron 3's mixture of experts (forja/models/common/moe.py):
  sigmoid router scores, a correction bias that only chooses (DeepSeek-V3's auxiliary-loss-free
  balancing), optionally grouped top-k, the chosen scores renormalized and scaled by
  `route_scale`; routed and shared experts are squared-ReLU MLPs without a gate. Nemotron 3
  Super's latent experts (`moe_latent_dim` > 0, `LatentMoE`): the router and the shared expert
  read the full-width input, the routed experts compute in the latent width, between a
  projection down (`to_latent`) and one back up (`from_latent`) applied to their weighted sum:
  y = from_latent(sum_k w_k expert_k(to_latent(x))) + shared(x);

in the order `layer_types` gives (Hugging Face's `layers_block_type`, or the older
`hybrid_override_pattern` string, M * - E). No block has both a mixer and a feed-forward
(forja/models/common/blocks.py MixerBlock, FeedForwardBlock). Every norm is an RMSNorm of
`norm_eps`, the Mamba-2's grouped gated norm too.

Parameter names: attention_norm, attention.{wz,wx,wB,wC,wdt,conv_x,conv_B,conv_C,A_log,D,
dt_bias,norm,wo} in Mamba-2 blocks; attention_norm, attention.{wq,wk,wv,wo} in attention
blocks; ffn_norm, feed_forward.{w1,w2} in MLP blocks; ffn_norm, feed_forward.{router.gate,
router.expert_bias, experts.w1 (E, H, D), experts.w2 (E, D, H), shared_experts.w1, shared_experts.w2}
in MoE blocks; with latent experts also feed_forward.{to_latent, from_latent}, and the experts'
D is moe_latent_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import Attention, AttentionMask, SequenceShards
from forja.models.common.blocks import FeedForwardBlock, MixerBlock
from forja.models.common.mamba2 import Mamba2Args
from forja.models.common.mlp import SquaredReLUMLP
from forja.models.common.moe import MoE, MoEArgs
from forja.models.common.norms import RMSNorm
from forja.models.common.transformer import Transformer, TransformerArgs

LAYER_TYPES = ("mamba2", "full_attention", "mlp", "moe")
"""Nemotron-H's kinds of block (TransformerArgs.layer_types)."""

# Hugging Face's pattern characters and forja's kinds of block.
PATTERN = {"M": "mamba2", "*": "full_attention", "-": "mlp", "E": "moe"}
FEED_FORWARD_KINDS = ("mlp", "moe")
"""The kinds of block that are only a feed-forward (no sequence mixer)."""


def nemotron_h_layer_types(pattern: str) -> tuple[str, ...]:
    """The kinds of block a `hybrid_override_pattern` string names ("M-M*-", ...)."""
    unknown = sorted(set(pattern) - set(PATTERN))
    if unknown:
        raise ForjaError(f"model layer pattern {pattern!r} holds {unknown[0]!r}; each block is one of "
                         f"{', '.join(PATTERN)} (Mamba-2, attention, MLP, mixture of experts)")
    return tuple(PATTERN[c] for c in pattern)


@dataclass(kw_only=True)
class NemotronHArgs(Mamba2Args, MoEArgs, TransformerArgs):
    """A Nemotron-H model's shape; the package's FLAVORS hold the published ones. `n_layers`
    must equal len(layer_types); n_experts > 0 exactly when some block is "moe". The routing
    defaults are Nemotron 3's (transformers' NemotronHTopkRouter)."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (Hugging Face `layer_norm_epsilon`), the Mamba-2 gated norm's too."""
    mlp_bias: bool = False
    """Biases on the MLP blocks' projections."""
    mamba_bias: bool = False
    """Biases on the Mamba-2 input and output projections (Hugging Face `use_bias`)."""
    score_func: str = "sigmoid"
    """Router scores: independent sigmoids (MoEArgs)."""
    expert_bias: bool = True
    """The router's correction bias (Hugging Face `e_score_correction_bias`), which only chooses."""
    expert_activation: str = "relu2"
    """Routed and shared experts: squared-ReLU MLPs without a gate."""
    n_shared_experts: int = 1
    """One shared expert, `shared_ffn_dim` wide (Hugging Face `moe_shared_expert_intermediate_size`)."""
    moe_latent_dim: int = 0
    """The routed experts' width (Hugging Face `moe_latent_size`, Nemotron 3 Super): their input
    projected down to it and their weighted sum back up to dim; 0: they compute at dim."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            raise ForjaError("model.layer_types is empty; a Nemotron-H names each block's kind "
                             f"({', '.join(LAYER_TYPES)})")
        super().__post_init__()
        if self.sliding_window is not None or self.attention_sinks or self.qk_norm:
            raise ForjaError("model.sliding_window, attention_sinks and qk_norm are not part of Nemotron-H's "
                             "attention; leave them unset")
        if ("moe" in self.layer_types) != (self.n_experts > 0):
            raise ForjaError(f"model.n_experts = {self.n_experts} with {self.layer_types.count('moe')} 'moe' blocks "
                             "in model.layer_types; set n_experts > 0 exactly when some block is 'moe'")
        self.check_moe()
        if self.moe_latent_dim < 0 or (self.moe_latent_dim and not self.n_experts):
            raise ForjaError(f"model.moe_latent_dim = {self.moe_latent_dim} needs 'moe' blocks and must not be "
                             "negative; set it to 0 (experts at the model's width) or add 'moe' blocks")
        if self.n_experts and self.expert_activation != "relu2":
            raise ForjaError(f"model.expert_activation = {self.expert_activation!r}: Nemotron-H's experts are "
                             "squared-ReLU MLPs; set it to 'relu2'")

    @property
    def supported_layer_types(self) -> tuple[str, ...]:
        return LAYER_TYPES

    def layer_type(self, layer: int) -> str:
        return "full_attention" if layer >= self.n_layers else self.layer_types[layer]

    def is_moe_layer(self, layer: int) -> bool:
        return self.layer_type(layer) == "moe"

    def split_counts(self) -> dict[str, int]:
        return {**self.head_counts(), "ffn_dim": self.ffn_dim}


class NemotronH(Transformer):
    """Nemotron-H: one-sublayer pre-norm blocks by `layer_types`, no positions."""

    args: NemotronHArgs

    def build_block(self, layer: int) -> nn.Module:
        a = self.args
        kind = a.layer_type(layer)
        if kind == "mlp":
            return FeedForwardBlock(SquaredReLUMLP(a.dim, a.ffn_dim, bias=a.mlp_bias), self.build_norm())
        if kind == "moe":  # the routed experts have no biases whatever mlp_bias says; the shared one does
            moe = LatentMoE(a.dim, a) if a.moe_latent_dim else MoE(a.dim, a, shared_bias=a.mlp_bias)
            return FeedForwardBlock(moe, self.build_norm())
        if kind == "mamba2":
            return MixerBlock(a.mamba2(norm_eps=a.norm_eps, bias=a.mamba_bias), self.build_norm())
        return MixerBlock(Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim), self.build_norm())

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps, fused="rms_norm" in self.args.fused_ops)

    def rope_tables_for(self, kind: str, positions: torch.Tensor) -> None:
        return None  # NoPE

    def mask_for(self, kind: str, document_ids: torch.Tensor | None, T: int, start: int,
                 device: torch.device, sequence: SequenceShards | None = None) -> AttentionMask | None:
        """Attention's causal mask within documents; a Mamba-2 block's documents (where its
        state starts afresh); nothing for an MLP or MoE block."""
        if kind in FEED_FORWARD_KINDS:
            return None
        if kind == "mamba2":
            kind = "linear_attention"  # a recurrent mixer's mask: the documents themselves
        return super().mask_for(kind, document_ids, T, start, device, sequence)

    def init_rule(self, name: str) -> tuple:
        """Std 0.02 truncated normals; the projections that write into the residual stream
        (attention and Mamba-2 wo, the MLP's and the experts' w2) shrink with depth as
        1/sqrt(n_layers), each block having one (transformers' rescale_prenorm_residual; with latent
        experts their from_latent, not w2); biases
        zero. A Mamba-2's own parameters: `mamba2_init_rule`."""
        if (rule := self.args.mamba2_init_rule(name)) is not None:
            return rule
        if name.endswith("norm.weight"):
            return ("ones",)
        if name.endswith(".bias"):
            return ("zeros",)
        if name == "tok_embeddings.weight":
            return ("normal", 0.02)
        if name == "output.weight":
            return ("trunc_normal", self.args.dim**-0.5)
        # With latent experts it is from_latent, not the experts' w2 (which writes the latent), that writes it.
        routed_out = "from_latent.weight" if self.args.moe_latent_dim else "experts.w2"
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", routed_out, "shared_experts.w2.weight")):
            return ("trunc_normal", 0.02 / math.sqrt(self.args.n_layers))
        return ("trunc_normal", 0.02)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        if kind == "mamba2":
            return self.args.mamba2_flops(seq_len)
        if kind in FEED_FORWARD_KINDS:
            return 0
        return super().mixer_flops(kind, seq_len)


class LatentMoE(MoE):
    """Nemotron 3 Super's mixture of experts: routed on the full-width input, its routed experts
    computing in `moe_latent_dim` between `to_latent` and `from_latent` (transformers'
    fc1_latent_proj and fc2_latent_proj, biased as the MLPs are: mlp_bias), the shared expert
    at full width. from_latent maps the experts' weighted sum, so its bias is added once."""

    def __init__(self, dim: int, args: NemotronHArgs):
        super().__init__(dim, args, shared_bias=args.mlp_bias, expert_dim=args.moe_latent_dim)
        self.to_latent = nn.Linear(dim, args.moe_latent_dim, bias=args.mlp_bias)
        self.from_latent = nn.Linear(args.moe_latent_dim, dim, bias=args.mlp_bias)

    def structure_fields(self) -> dict:
        return {**super().structure_fields(), "expert_width": self.args.moe_latent_dim}

    def to_expert_width(self, flat: torch.Tensor) -> torch.Tensor:
        return self.to_latent(flat)  # (N, L)

    def from_expert_width(self, y: torch.Tensor) -> torch.Tensor:
        return self.from_latent(y)  # (N, D)
