"""Kimi Linear (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv 2510.26692), single-device: a hybrid of Kimi Delta Attention and latent attention, with
DeepSeek-V3's mixture of experts.

- Most blocks mix the sequence with Kimi Delta Attention (forja/models/common/kimi_delta_attention.py):
  a gated delta rule whose decay is per key channel; the others (`layer_types` full_attention,
  one in four in the published model) with multi-head latent attention (forja/models/common/mla.py)
  without any rotary position (NoPE): the qk_rope_head_dim-wide parts are computed as
  DeepSeek's, one shared key head, but nothing rotates them; the convolutions and decays of
  the KDA blocks carry position.
- The blocks in `dense_layers` have a SwiGLU of ffn_dim, every other a DeepSeekMoE layer
  (forja/models/common/moe.py): sigmoid scores, the balancing bias, grouped top-k, the
  chosen weights renormalized and scaled by `route_scale`, shared experts.
- RMSNorm pre-norm blocks, untied embeddings.

Parameter names: attention.{wq | wq_a, q_norm, wq_b}, attention.{wkv_a, kv_norm, wkv_b, wo} in
latent-attention blocks; attention.{wq, wk, wv, conv_q, conv_k, conv_v, wf_a, wf_b, A_log,
dt_bias, wb, wg_a, wg_b, norm, wo} in KDA blocks; feed_forward as DeepSeek-V3's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import KVCache
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.kimi_delta_attention import KimiDeltaArgs
from forja.models.common.mla import MLA, LatentAttentionArgs
from forja.models.common.moe import MoEArgs
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class KimiLinearArgs(KimiDeltaArgs, TransformerArgs, MoEArgs, LatentAttentionArgs):
    """A Kimi Linear model's shape; the package's FLAVORS hold the published one. `head_dim` is the
    latent attention's query/key width qk_nope_head_dim + qk_rope_head_dim; `ffn_dim` the dense
    blocks' MLP; `layer_types` which blocks are KDA (linear_attention) and which MLA (full_attention)."""

    norm_eps: float = 1e-5
    """Epsilon of the blocks', the final and the KDA output RMSNorms (Hugging Face `rms_norm_eps`)."""
    dense_layers: tuple[int, ...] = (0,)
    """Blocks (0-based) with a dense SwiGLU of ffn_dim; every other is a mixture of experts
    (Hugging Face `mlp_layer_types`, or its first `first_k_dense_replace` blocks)."""
    q_lora_rank: int = 0
    """Width of the query latent; 0 projects queries directly (the published model)."""
    kv_lora_rank: int = 512
    """Width of the key/value latent c_kv."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimensions computed from the latent."""
    qk_rope_head_dim: int = 64
    """Per-head query dimensions matched against one key head shared by all (DeepSeek's
    decoupled rotary part, here not rotated)."""
    v_head_dim: int = 128
    """Per-head value width."""

    def __post_init__(self) -> None:
        self.dense_layers = tuple(sorted(int(i) for i in self.dense_layers))  # a list from TOML or config.json
        self.check_latent_attention("Kimi Linear")
        if self.q_lora_rank < 0 or self.mtp_depth:
            raise ForjaError(f"model.q_lora_rank={self.q_lora_rank} must be at least 0 and model.mtp.depth="
                             f"{self.mtp_depth} 0 (Kimi Linear has no multi-token prediction module)")
        if not self.layer_types:  # transformers' default: latent attention in every fourth block after the first
            self.layer_types = tuple("full_attention" if i and i % 4 == 0 else "linear_attention"
                                     for i in range(self.n_layers))
        super().__post_init__()
        if any(not 0 <= i < self.n_layers for i in self.dense_layers):
            raise ForjaError(f"model.dense_layers={list(self.dense_layers)} must name blocks 0..{self.n_layers - 1}")
        self.check_moe()

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers


class KimiLinear(RotaryDecoder):
    """RotaryDecoder's blocks, norms and feed-forwards with KDA or NoPE latent attention as mixer."""

    args: KimiLinearArgs

    def build_attention(self, layer: int) -> nn.Module:
        a = self.args
        if a.layer_type(layer) == "linear_attention":
            return a.kimi_delta(norm_eps=a.norm_eps)
        return MLA(a.dim, a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                   qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                   v_head_dim=a.v_head_dim, softmax_scale=a.head_dim**-0.5, fused_norm="rms_norm" in a.fused_ops)

    def rope_tables(self, positions: torch.Tensor) -> None:
        """None: the latent attention rotates nothing (NoPE)."""
        return None

    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        a = self.args
        weight = self.tok_embeddings.weight
        attention = [i for i in range(a.n_layers) if a.layer_type(i) == "full_attention"]
        return KVCache(a.n_layers, batch, max_len or a.max_seq_len, a.n_heads, a.head_dim, value_dim=a.v_head_dim,
                       dtype=weight.dtype, device=weight.device, layers=attention)

    def init_rule(self, name: str) -> tuple:
        """RotaryDecoder's, with a KDA block's own parameters by `kimi_delta_init_rule`."""
        rule = self.args.linear_init_rule(name)
        return rule if rule is not None else super().init_rule(name)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """A KDA block's chunked rule; a latent-attention block's scores (q . k over dn + dr) and
        weighted values (dv), 2 FLOPs each forward and 4 backward, over the full T x T square."""
        a = self.args
        if kind == "linear_attention":
            return a.linear_attention_flops(seq_len)
        return 6 * a.n_heads * (a.head_dim + a.v_head_dim) * seq_len
