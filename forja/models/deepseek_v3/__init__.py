"""DeepSeek-V2/V3: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published DeepSeek-V2/V3 sizes, plus a small one for tests and laptops.

Values are those of the released config.json files (deepseek-ai/DeepSeek-V2-Lite,
DeepSeek-V2, DeepSeek-V3 on the Hugging Face hub). V3's multi-token prediction module
(num_nextn_predict_layers = 1) is off in the flavors (`671b` counts the main model, as
transformers builds it); `[model.mtp] depth = 1` adds it (forja/models/common/mtp.py).
V2 routes differently from V3 (softmax scores without a balancing bias, "group-limited
greedy" choosing groups by their best expert), which `score_func`, `expert_bias` and
`group_score` express; transformers' DeepseekV3ForCausalLM, the reference
forja checks itself against, computes V3's routing only (see docs/models.md).
"""

from forja.models.common.rope import YarnScaling
from forja.models.deepseek_v3.hf import ADAPTER
from forja.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args
from forja.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from forja.models.spec import ModelSpec

# Every released V2/V3 config: 4K pre-training context extended 40x to 160K with YaRN.
_YARN = dict(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0)
_V2_YARN = YarnScaling(mscale=0.707, mscale_all_dim=0.707, **_YARN)
_V3_YARN = YarnScaling(mscale=1.0, mscale_all_dim=1.0, **_YARN)
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_V2 = dict(vocab_size=102_400, max_seq_len=163_840, norm_eps=1e-6, rope_theta=10_000.0, rope_scaling=_V2_YARN,
           score_func="softmax", expert_bias=False, norm_topk_prob=False, group_score="max", n_dense_layers=1,
           **_MLA)

FLAVORS: dict[str, dict] = {
    # ~1.9M parameters (1.2M active): unit tests and parity runs. Every feature on: a query
    # latent, YaRN (original context 64 < the tests' sequences), grouped sigmoid routing
    # with the balancing bias, a shared expert, a dense first block.
    "debug": dict(dim=128, n_layers=4, n_heads=4, ffn_dim=384, vocab_size=2048, max_seq_len=256,
                  n_dense_layers=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, rope_theta=10_000.0,
                  rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=64, mscale=1.0, mscale_all_dim=1.0),
                  n_experts=8, top_k=2, moe_ffn_dim=96, n_shared_experts=1, score_func="sigmoid",
                  expert_bias=True, norm_topk_prob=True, route_scale=2.5, n_expert_groups=2, topk_groups=1),
    # DeepSeek-V2-Lite: 15.7B total, 2.4B active; queries without a latent, no expert groups.
    "16b": dict(dim=2048, n_layers=27, n_heads=16, ffn_dim=10_944, q_lora_rank=0,
                n_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2, route_scale=1.0,
                n_expert_groups=1, topk_groups=1, **_V2),
    # DeepSeek-V2: 236B total, 21B active.
    "236b": dict(dim=5120, n_layers=60, n_heads=128, ffn_dim=12_288, q_lora_rank=1536,
                 n_experts=160, top_k=6, moe_ffn_dim=1536, n_shared_experts=2, route_scale=16.0,
                 n_expert_groups=8, topk_groups=3, **_V2),
    # DeepSeek-V3 (and R1, V3.1: the same shapes): 671B total, 37B active.
    "671b": dict(dim=7168, n_layers=61, n_heads=128, ffn_dim=18_432, q_lora_rank=1536, vocab_size=129_280,
                 max_seq_len=163_840, norm_eps=1e-6, rope_theta=10_000.0, rope_scaling=_V3_YARN,
                 n_dense_layers=3, n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
                 score_func="sigmoid", expert_bias=True, norm_topk_prob=True, route_scale=2.5,
                 n_expert_groups=8, topk_groups=4, group_score="top2_sum", **_MLA),
}

SPEC = ModelSpec("deepseek_v3", DeepSeekV3, DeepSeekV3Args, FLAVORS, ADAPTER, tp_plan=deepseek_v3_tp_plan)
