"""GLM-5: `model.py` the model, `hf.py` its checkpoints; its TP plan is DeepSeek-V3.2's.

DeepSeek-V3.2's architecture (MLA + DeepSeek Sparse Attention, DeepSeekMoE) at GLM-5's size.
The published flavor takes the shape transformers' GlmMoeDsaConfig defaults to (its docstring
names the zai-org/GLM-5 checkpoint): 78 blocks of width 6144, 64 heads with 192 + 64 query/key
and 256 value dimensions, a 2048-wide query latent, 256 experts (8 routed per token, one
shared, no groups), 3 dense blocks, a 32-head indexer choosing 2048 keys. Its rope_theta
(transformers' default, 10 000) changes no count; set the checkpoint's own when training from it.
"""

from forja.models.deepseek_v32 import FLAVORS as V32_FLAVORS
from forja.models.deepseek_v32.parallelize import deepseek_v32_tp_plan
from forja.models.glm5.hf import ADAPTER
from forja.models.glm5.model import GLM5, GLM5Args
from forja.models.spec import ModelSpec

FLAVORS: dict[str, dict] = {
    # ~2M parameters: DeepSeek-V3.2's debug model, its indexer's pairs interleaved.
    "debug": dict(V32_FLAVORS["debug"], index_rope_interleaved=True),
    # GLM-5 (zai-org/GLM-5's config.json as transformers' GlmMoeDsaConfig holds it): 744B total, 40B active.
    "744b": dict(dim=6144, n_layers=78, n_heads=64, ffn_dim=12_288, vocab_size=154_880, max_seq_len=202_752,
                 norm_eps=1e-5, rope_theta=10_000.0, rope_scaling=None, n_dense_layers=3, q_lora_rank=2048,
                 kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_experts=256,
                 top_k=8, moe_ffn_dim=2048, n_shared_experts=1, score_func="sigmoid", expert_bias=True,
                 norm_topk_prob=True, route_scale=2.5, n_expert_groups=1, topk_groups=1, group_score="top2_sum",
                 index_n_heads=32, index_head_dim=128, index_topk=2048, index_rope_interleaved=True),
}

SPEC = ModelSpec("glm5", GLM5, GLM5Args, FLAVORS, ADAPTER, tp_plan=deepseek_v32_tp_plan)
