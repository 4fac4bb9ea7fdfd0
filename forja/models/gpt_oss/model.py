"""gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025, arXiv 2508.10925), single-device.

A pre-norm RMSNorm decoder (eps 1e-5) whose every feed-forward is a mixture of experts:

- grouped-query attention (64 query heads of width 64, 8 key/value heads) with biases on
  q, k, v and o, and a learned sink logit per head that joins each softmax with no value
  (forja's `attend(..., sinks=)`: a head may attend to nothing);
- blocks alternate sliding-window (the latest 128 positions, itself included) and full
  attention, starting with a sliding one (Hugging Face's `layer_types` default);
- rotary positions (base 150,000, rotate-half layout) with YaRN scaling: factor 32 over an
  original 4,096-token context, beta_fast 32, beta_slow 1, the ramp's bounds not rounded to
  whole dimensions (`truncate: false`), cos and sin times 0.1 ln(32) + 1;
- the router is a Linear with bias; each token takes its top_k logits, then a softmax over
  those k alone (`score_func="topk_softmax"`); the experts' gate, up and down projections
  have biases, and their activation is the clamped SwiGLU
  (up + 1) * g * sigmoid(1.702 g), g = min(gate, 7), up clamped to [-7, 7];
- untied embeddings, no shared expert, no dense block.

Parameter names follow the TP plan (the dense one of common/tp_plan.py): attention.wq/wk/wv/wo (weight and
bias), attention.sinks, feed_forward.router.gate (weight, bias), feed_forward.experts.w1/w3
(E, H, D), w2 (E, D, H), b1/b3 (E, H), b2 (E, D).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forja.models.common.attention import Attention
from forja.models.common.decoder import RotaryDecoder, experts_only
from forja.models.common.moe import MoEArgs
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


def _gpt_oss_yarn() -> YarnScaling:
    return YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)


def alternating_layer_types(n_layers: int) -> tuple[str, ...]:
    """Sliding, full, sliding, full, ...: Hugging Face's GptOssConfig default."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))


@dataclass(kw_only=True)
class GptOssArgs(TransformerArgs, MoEArgs):
    """A gpt-oss model's shape; the package's FLAVORS hold the published sizes. Its experts are its
    only feed-forward, so `ffn_dim` (Hugging Face's `intermediate_size`) is one expert's
    hidden width and `moe_ffn_dim` follows it. Empty `layer_types`: alternating sliding and
    full attention, sliding first."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (Hugging Face `rms_norm_eps`)."""
    attention_bias: bool = True
    """Biases on the q, k, v and o projections (`attention_bias`; true in the released models)."""
    attention_sinks: bool = True
    """A learned sink logit per attention head (every released gpt-oss has them)."""
    sliding_window: int | None = 128
    """Positions a sliding-attention block sees, itself included."""
    rope_theta: float = 150_000.0
    """Base of the rotary frequencies."""
    rope_scaling: YarnScaling | RopeScaling | None = field(default_factory=_gpt_oss_yarn)
    """YaRN frequency scaling (a dict of YarnScaling's fields from TOML); None: plain RoPE."""
    n_experts: int = 32
    """Routed experts per block (Hugging Face `num_local_experts`)."""
    top_k: int = 4
    """Experts each token is sent to (`num_experts_per_tok`)."""
    score_func: Literal["softmax", "sigmoid", "topk_softmax"] = "topk_softmax"
    """gpt-oss routes by a softmax over the chosen top_k logits."""
    router_bias: bool = True
    """The router's Linear has a bias."""
    expert_proj_bias: bool = True
    """The experts' projections have biases."""
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "clamped_swiglu"
    """The experts' clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`)."""

    def __post_init__(self) -> None:
        # A table from TOML or a flavor override; YaRN unless its rope_type says "llama3".
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        if not self.layer_types:
            self.layer_types = alternating_layer_types(self.n_layers)
        experts_only(self, "gpt-oss")
        super().__post_init__()
        self.check_moe()


class GptOss(RotaryDecoder):
    args: GptOssArgs

    def build_attention(self, layer: int) -> Attention:
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, bias=a.attention_bias, qk_norm=a.qk_norm,
                         norm_eps=a.norm_eps, fused_rope="rope" in a.fused_ops, sinks=a.attention_sinks)

    def init_rule(self, name: str) -> tuple:
        """Llama's rule (`RotaryDecoder.init_rule`), with every bias (attention, router,
        experts' b1/b2/b3) and the sinks starting at zero."""
        if name.endswith(".bias") or name.endswith(("experts.b1", "experts.b2", "experts.b3")):
            return ("zeros",)
        return super().init_rule(name)
