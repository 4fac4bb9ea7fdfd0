"""DeepSeek-V4: `model.py` the model, `hf.py` its checkpoints (transformers 5.25's
DeepseekV4ForCausalLM), `parallelize.py` its TP plan; tests/unit/models/test_deepseek_v4.py
checks it against transformers.

FLAVORS holds the test size only: the published checkpoints' per-layer schedules
(`compress_ratios`) are not known here with certainty, so no published size is given.
"""

from forja.models.deepseek_v4.hf import ADAPTER
from forja.models.deepseek_v4.model import DeepSeekV4, DeepSeekV4Args
from forja.models.deepseek_v4.parallelize import deepseek_v4_tp_plan
from forja.models.spec import ModelSpec

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
}

SPEC = ModelSpec("deepseek_v4", DeepSeekV4, DeepSeekV4Args, FLAVORS, ADAPTER, tp_plan=deepseek_v4_tp_plan)
