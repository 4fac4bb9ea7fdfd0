"""DeepSeek-V4: `model.py` the model, `hf.py` its checkpoints (transformers 5.25's
DeepseekV4ForCausalLM), `parallelize.py` its TP plan; tests/unit/models/test_deepseek_v4.py
checks it against transformers.

"flash" is the shape of DeepSeek-V4-Flash (284B total, 13B active, as published): the values of
transformers 5.25's DeepseekV4Config defaults, which it documents against
deepseek-ai/DeepSeek-V4-Flash-Base (43 blocks of width 4,096, 64 query heads of 512 over one
shared key/value head, a 1,024-wide query latent, 8 output groups, 256 routed experts 2,048 wide,
top 6, one shared expert, the first 3 hash-routed, 4 hyper-connection streams), with the attention
schedule of the Flash model card (two sliding-window blocks, then compressed sparse attention at
ratio 4 and heavily compressed attention at ratio 128 alternating). Its total, 284.33B, equals
transformers' model built from that config on the meta device (tests/unit/models/test_deepseek_v4.py).
The compressed blocks' YaRN (factor 16 over 65,536 positions, beta 32 and 1, cos and sin
unscaled) is the released config.json's, as copies of it in public code quote it and as
transformers' DeepseekV4Config comments it. Not set: its MTP layer, which transformers does not
build (`[model.mtp] depth = 1` adds it: 6.61B more).

"pro" is the shape of DeepSeek-V4-Pro (1.6T total, 49B active, as published): the values of its
config.json as public code quotes it (this machine cannot reach the hub: one project's copy of the
whole file, the others' Pro presets and fixtures agreeing key by key): 61 blocks of width 7,168,
128 query heads of 512 over one shared key/value head, a 1,536-wide query latent, 16 output groups
of rank 1,024, an indexer of 64 heads of 128 keeping the top 1,024, 384 routed experts 3,072 wide,
top 6, scaled by 2.5, one shared expert, the first 3 hash-routed, 4 hyper-connection streams, and
its `compress_ratios` schedule (two heavily compressed blocks, then ratio 4 and ratio 128
alternating, no sliding-only block; the list's 62nd entry is the MTP layer's). Its total,
1,572,997,179,491 (49.78B active), equals transformers' model built from that config on the meta
device. The YaRN scaling is the quoted config's, as for "flash". Not set: its MTP layer
(`[model.mtp] depth = 1`: 25.84B more).
"""

from forja.models.common.rope import YarnScaling
from forja.models.deepseek_v4.hf import ADAPTER
from forja.models.deepseek_v4.model import DeepSeekV4, DeepSeekV4Args
from forja.models.deepseek_v4.parallelize import deepseek_v4_tp_plan
from forja.models.spec import ModelSpec

# The released checkpoints' compressed-block YaRN (the sliding blocks' RoPE is plain).
_YARN = YarnScaling(factor=16.0, original_max_seq_len=65_536, beta_fast=32.0, beta_slow=1.0, attention_factor=1.0)

FLAVORS: dict[str, dict] = {
    # ~1.5M parameters: every mechanism on (HCA, CSA with its indexer, a sliding block, hash
    # and top-k routed experts, 4 hyper-connection streams), windows short enough for tests.
    "debug": dict(dim=128, n_layers=4, n_heads=4, head_dim=64, ffn_dim=64, vocab_size=2048, max_seq_len=256,
                  q_lora_rank=64, rope_dim=16, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32,
                  index_topk=4, csa_ratio=4, hca_ratio=8, sliding_window=16, hc_mult=4, hc_sinkhorn_iters=20,
                  layer_types=("heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                               "compressed_sparse_attention"),
                  n_hash_layers=1, n_experts=6, top_k=2, n_shared_experts=1, score_func="sqrtsoftplus",
                  route_scale=1.5, expert_bias=True, swiglu_limit=10.0),
    "flash": dict(dim=4096, n_layers=43, n_heads=64, n_kv_heads=1, head_dim=512, ffn_dim=2048, moe_ffn_dim=2048,
                  vocab_size=129_280, max_seq_len=1_048_576, norm_eps=1e-6, q_lora_rank=1024, rope_dim=64,
                  rope_theta=10_000.0, compress_rope_theta=160_000.0, o_groups=8, o_lora_rank=1024,
                  index_n_heads=64, index_head_dim=128, index_topk=512, csa_ratio=4, hca_ratio=128,
                  sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20,
                  layer_types=("sliding_attention",) * 2 + ("compressed_sparse_attention",
                                                            "heavily_compressed_attention") * 20
                  + ("compressed_sparse_attention",),
                  n_hash_layers=3, n_experts=256, top_k=6, n_shared_experts=1, score_func="sqrtsoftplus",
                  route_scale=1.5, expert_bias=True, swiglu_limit=10.0, rope_scaling=_YARN),
    "pro": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=1, head_dim=512, ffn_dim=3072, moe_ffn_dim=3072,
                vocab_size=129_280, max_seq_len=1_048_576, norm_eps=1e-6, q_lora_rank=1536, rope_dim=64,
                rope_theta=10_000.0, compress_rope_theta=160_000.0, o_groups=16, o_lora_rank=1024,
                index_n_heads=64, index_head_dim=128, index_topk=1024, csa_ratio=4, hca_ratio=128,
                sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20,
                layer_types=("heavily_compressed_attention",) * 2 + ("compressed_sparse_attention",
                                                                     "heavily_compressed_attention") * 29
                + ("compressed_sparse_attention",),
                n_hash_layers=3, n_experts=384, top_k=6, n_shared_experts=1, score_func="sqrtsoftplus",
                route_scale=2.5, expert_bias=True, swiglu_limit=10.0, rope_scaling=_YARN),
}

SPEC = ModelSpec("deepseek_v4", DeepSeekV4, DeepSeekV4Args, FLAVORS, ADAPTER, tp_plan=deepseek_v4_tp_plan)
