"""OLMo-Hybrid (Ai2, 2026), single-device: OLMo 3's attention blocks interleaved with Gated DeltaNet.

Three of every four blocks mix the sequence with Gated DeltaNet (forja/models/common/gated_deltanet.py:
separate q/k/v/gate/beta/decay projections, short convolutions, a gated output RMSNorm of
eps 1e-5 whatever the model's), with OLMo-Hybrid's `allow_neg_eigval` (beta doubled, so
the state's transition may flip sign). Every fourth block is OLMo 3's attention block. The
two kinds of block are built differently, as transformers 5.24's OlmoHybridModel builds them:

- Gated DeltaNet blocks are pre-norm, Llama's: x + mixer(norm(x)), then x + mlp(norm(x))
  (attention_norm, ffn_norm);
- attention blocks are OLMo 3's post-norm blocks (forja/models/olmo3/model.py PostNormBlock):
  h = x + post_attention_norm(attn(x)), then h + post_ffn_norm(mlp(h)), with QK-norm over the
  whole query and key projections, and no sliding window.

Positions: the attention blocks rotate queries and keys with RoPE when `rope_theta` is set
(transformers' config default, 10,000) and carry no positions at all when it is None (NoPE:
the released checkpoints, whose convolutions and decays carry order instead).

Parameter names: attention.wq/wk/wv/wo, attention.q_norm/k_norm, post_attention_norm,
post_ffn_norm in attention blocks; attention.wq/wk/wv/wz/wb/wa/wo, conv_q/k/v, A_log,
dt_bias, norm, attention_norm, ffn_norm in Gated DeltaNet blocks; feed_forward.w1/w2/w3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import Attention
from forja.models.common.blocks import PostNormBlock
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.gated_deltanet import GatedDeltaNetArgs
from forja.models.common.rope import Scaling, rope_frequencies, rope_scaling_from
from forja.models.common.transformer import TransformerArgs

# The output norm of OLMo-Hybrid's Gated DeltaNet: fla's FusedRMSNormGated default, which
# transformers keeps whatever rms_norm_eps says.
GATED_NORM_EPS = 1e-5


def olmo_hybrid_layer_types(n_layers: int) -> tuple[str, ...]:
    """Three Gated DeltaNet blocks, then one attention block, repeated; the last block is
    attention when there would be none (transformers' OlmoHybridConfig default)."""
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return tuple(kinds)


@dataclass(kw_only=True)
class OlmoHybridArgs(GatedDeltaNetArgs, TransformerArgs):
    """An OLMo-Hybrid model's shape; the package's FLAVORS hold the published size. Empty
    `layer_types`: `olmo_hybrid_layer_types(n_layers)`."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm but the Gated DeltaNet's output norm (Hugging Face `rms_norm_eps`)."""
    qk_norm: bool = True
    """RMSNorm over the whole query and key projections in the attention blocks."""
    rope_theta: float | None = 10_000.0
    """Base of the attention blocks' rotary frequencies; None: no rotary positions (NoPE)."""
    rope_scaling: Scaling | None = None
    """The rotary frequencies' scaling (model.overrides.rope_scaling: a table whose rope_type is
    "linear", "llama3" or "yarn"); None: plain RoPE."""
    # The 7B's Gated DeltaNet (GatedDeltaNetArgs' fields; value heads a multiple of the key heads).
    linear_n_k_heads: int = 30
    linear_n_v_heads: int = 30
    linear_k_head_dim: int = 96
    linear_v_head_dim: int = 192
    linear_allow_neg_eigval: bool = True
    """Beta in (0, 2) instead of (0, 1): the state's transition may have negative eigenvalues."""
    linear_a_log_min: float = 0.0
    """A = exp(A_log) is initialized uniform in [linear_a_log_min, linear_a_log_max]."""
    linear_a_log_max: float = 16.0
    """See linear_a_log_min."""
    linear_dt_min: float = 0.001
    """softplus(dt_bias) is initialized log-uniform in [linear_dt_min, linear_dt_max]..."""
    linear_dt_max: float = 0.1
    """See linear_dt_min."""
    linear_dt_init_floor: float = 1e-4
    """...and at least this."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = olmo_hybrid_layer_types(self.n_layers)
        super().__post_init__()
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        if not 0 <= self.linear_a_log_min <= self.linear_a_log_max:
            raise ForjaError(f"model.linear_a_log_min={self.linear_a_log_min} and model.linear_a_log_max="
                             f"{self.linear_a_log_max} must satisfy 0 <= min <= max (A = exp(A_log) is a decay rate)")
        if not 0 < self.linear_dt_min <= self.linear_dt_max:
            raise ForjaError(f"model.linear_dt_min={self.linear_dt_min} and model.linear_dt_max="
                             f"{self.linear_dt_max} must satisfy 0 < min <= max (time steps, drawn log-uniformly)")


class OlmoHybrid(RotaryDecoder):
    args: OlmoHybridArgs

    def build_block(self, layer: int) -> nn.Module:
        if self.args.layer_type(layer) == "linear_attention":
            return super().build_block(layer)  # pre-norm
        return PostNormBlock(self.build_attention(layer), self.build_feed_forward(layer),
                             self.build_norm(), self.build_norm())

    def build_attention(self, layer: int) -> nn.Module:
        a = self.args
        if a.layer_type(layer) == "linear_attention":
            return a.gated_deltanet(norm_eps=GATED_NORM_EPS, allow_neg_eigval=a.linear_allow_neg_eigval)
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, qk_norm=a.qk_norm, norm_eps=a.norm_eps,
                         fused_rope="rope" in a.fused_ops, sinks=a.attention_sinks, qk_norm_over_heads=True)

    def rope_frequencies(self) -> torch.Tensor:
        return rope_frequencies(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling)

    def rope_tables_for(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.args.rope_theta is None:  # NoPE
            return None
        return super().rope_tables_for(kind, positions)

    def init_rule(self, name: str) -> tuple:
        """RotaryDecoder's, but a Gated DeltaNet's A_log and dt_bias drawn from the args' ranges,
        as transformers' OlmoHybridPreTrainedModel draws them."""
        a = self.args
        if a.linear_init_rule(name) is not None and name.endswith((".A_log", ".dt_bias")):
            if name.endswith(".A_log"):
                return ("uniform_log", a.linear_a_log_min, a.linear_a_log_max)
            return ("inv_softplus", a.linear_dt_min, a.linear_dt_max, a.linear_dt_init_floor)
        return super().init_rule(name)
