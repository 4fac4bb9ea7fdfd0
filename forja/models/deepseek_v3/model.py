"""DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, arXiv 2412.19437), single-device.

Also the shapes of DeepSeek-V2 and V2-Lite (arXiv 2405.04434), which share the architecture:

- multi-head latent attention (forja/models/common/mla.py) with decoupled rotary positions
  over qk_rope_head_dim dimensions, YaRN-scaled for long context;
- the first `n_dense_layers` blocks have a dense SwiGLU (ffn_dim wide), every later one a
  DeepSeekMoE layer (forja/models/common/moe.py): fine-grained routed experts plus shared
  experts every token goes through. V3 routes by sigmoid scores, chooses among the best
  `topk_groups` of `n_expert_groups` groups (a group's score: the sum of its two best
  experts'), balances load with a per-expert bias that only picks experts (auxiliary-loss
  free), renormalizes the chosen k weights and multiplies them by `route_scale`;
- RMSNorm pre-norm blocks, untied embeddings.

- multi-token prediction (`mtp_depth`, Hugging Face `num_nextn_predict_layers`): V3's
  sequential MTP modules (forja/models/common/mtp.py), each an MoE block numbered after the
  main layers (`mtp.layers.{n_layers + k - 1}`), a training objective; off (0) in the flavors.

Parameter names: attention.{wq | wq_a, q_norm, wq_b}, attention.{wkv_a, kv_norm, wkv_b, wo};
feed_forward.w1/w2/w3 in dense blocks, feed_forward.{router.gate, experts.w1/w2/w3,
shared_experts.w1/w2/w3} in MoE blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from forja.errors import ForjaError
from forja.models.common.attention import KVCache
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.mla import MLA, LatentAttentionArgs
from forja.models.common.moe import MoEArgs
from forja.models.common.rope import RopeScaling, YarnScaling, rope_frequencies, rope_scaling_from
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class DeepSeekV3Args(TransformerArgs, MoEArgs, LatentAttentionArgs):
    """A DeepSeek-V2/V3 model's shape; the package's FLAVORS hold the published sizes. `head_dim` is
    the query/key width qk_nope_head_dim + qk_rope_head_dim; `ffn_dim` the dense blocks' MLP."""

    norm_eps: float = 1e-6
    """Epsilon of the blocks' and the final RMSNorm (Hugging Face `rms_norm_eps`)."""
    n_dense_layers: int = 1
    """The first this-many blocks have a dense MLP, the rest experts (`first_k_dense_replace`)."""
    q_lora_rank: int = 0
    """Width of the query latent; 0 projects queries directly (V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the key/value latent c_kv, the part MLA compresses to."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimensions without rotary positions."""
    qk_rope_head_dim: int = 64
    """Per-head query dimensions with rotary positions (one key head of them, shared)."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_theta: float = 10_000.0
    """Base of the rotary frequencies."""
    rope_scaling: YarnScaling | RopeScaling | None = None
    """YaRN frequency scaling; None for plain RoPE."""
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    """Router scores: independent sigmoids (V3) or a softmax over experts (V2)."""
    expert_bias: bool = True
    """V3's auxiliary-loss-free balancing bias (Hugging Face `e_score_correction_bias`)."""

    def __post_init__(self) -> None:
        # A table from TOML or a flavor override; YaRN unless its rope_type says "llama3".
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        self.check_latent_attention("DeepSeek-V3")
        if self.qk_rope_head_dim % 2 or self.q_lora_rank < 0 or self.n_dense_layers < 0:
            raise ForjaError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even, q_lora_rank="
                             f"{self.q_lora_rank} and n_dense_layers={self.n_dense_layers} at least 0")
        super().__post_init__()
        self.check_moe()

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.n_dense_layers

    def softmax_scale(self) -> float:
        """1/sqrt(query/key width), times YaRN's mscale^2 when the scaling has mscale_all_dim."""
        scale = self.head_dim**-0.5
        return scale if self.rope_scaling is None else self.rope_scaling.softmax_scale(scale)


class DeepSeekV3(RotaryDecoder):
    args: DeepSeekV3Args

    def build_attention(self, layer: int) -> MLA:
        a = self.args
        return MLA(a.dim, a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                   qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                   v_head_dim=a.v_head_dim, softmax_scale=a.softmax_scale(),
                   fused_rope="rope" in a.fused_ops, fused_norm="rms_norm" in a.fused_ops)

    def rope_frequencies(self) -> torch.Tensor:
        a = self.args  # only the decoupled rope part of each head rotates
        return rope_frequencies(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)

    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        a = self.args
        weight = next(iter(self.layers.values())).attention.wkv_b.weight
        return KVCache(a.n_layers, batch, max_len or a.max_seq_len, a.n_heads, a.head_dim, value_dim=a.v_head_dim,
                       dtype=weight.dtype, device=weight.device)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """The scores (q . k over dn + dr) and weighted values (dv) of one block, 2 FLOPs each
        forward and 4 backward, over the full T x T square."""
        a = self.args
        return 6 * a.n_heads * (a.head_dim + a.v_head_dim) * seq_len
