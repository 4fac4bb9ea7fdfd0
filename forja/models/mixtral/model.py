"""Mixtral (Mistral AI, Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088), single-device.

Mistral 7B's decoder with every feed-forward a sparse mixture of experts: RMSNorm pre-norm
blocks (eps 1e-5), grouped-query attention (32 query heads, 8 key/value heads, no biases,
no QK-norm) with plain rotary positions (base 1e6), untied embeddings, and in each block
8 SwiGLU experts of which each token goes to 2. The router takes a softmax over all the
experts, keeps the best top_k and divides them by their sum (forja's `Router` with
`score_func="softmax"`, `norm_topk_prob=True`); there is no shared expert and no dense block.

Optional sliding-window attention (Hugging Face's `sliding_window`, None in the released
8x7B and 8x22B): every block sees the latest `sliding_window` positions, itself included,
which is forja's `TransformerArgs.sliding_window` exactly.

Parameter names follow the TP plan (the dense one of common/tp_plan.py) and Llama's: attention.wq/wk/wv/wo,
feed_forward.router.gate and feed_forward.experts.w1/w3 (E, H, D), w2 (E, D, H).
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.models.common.decoder import RotaryDecoder, experts_only
from forja.models.common.moe import MoEArgs
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class MixtralArgs(TransformerArgs, MoEArgs):
    """A Mixtral model's shape; the package's FLAVORS hold the published sizes. Its experts are its
    only feed-forward, so `ffn_dim` (Hugging Face's `intermediate_size`) is one expert's
    hidden width and `moe_ffn_dim` follows it."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (Hugging Face `rms_norm_eps`)."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | YarnScaling | None = None
    """YaRN (the default rope_type here) or Llama 3's frequency scaling (model.rope_scaling); None: plain RoPE."""
    n_experts: int = 8
    """Routed experts per block (Hugging Face `num_local_experts`)."""
    top_k: int = 2
    """Experts each token is sent to (`num_experts_per_tok`)."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        experts_only(self, "Mixtral", ", or use the llama family for a dense model")
        super().__post_init__()
        self.check_moe()


class Mixtral(RotaryDecoder):
    """RotaryDecoder as it stands: grouped-query attention, whole-head RoPE, every block's
    feed-forward a mixture of experts (`MixtralArgs.is_moe_layer`)."""

    args: MixtralArgs
