"""Kimi Linear: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published Kimi Linear sizes, plus a small one for tests and laptops.

`48b-a3b` is moonshotai/Kimi-Linear-48B-A3B (Base and Instruct share the shape), from its
released config.json: 27 blocks, Kimi Delta Attention (32 heads of 128, convolutions of 4
taps) in all but blocks 4, 8, 12, 16, 20, 24 and 27 (1-based, `linear_attn_config`
full_attn_layers), which are NoPE latent attention (32 heads, a 512-wide key/value latent,
no query latent, 128 + 64 query/key and 128 value widths); block 1 a dense SwiGLU of 9216,
the rest 256 experts of 1024 (8 chosen by sigmoid scores with the balancing bias, one
group, renormalized, scaled by 2.446) plus one shared expert; a 163,840-token vocabulary;
1,048,576 positions (`model_max_length`). Parameter counts: tests/unit/models/test_kimi_linear.py
(equal to transformers' model built on the meta device).
"""

from forja.models.kimi_linear.hf import ADAPTER
from forja.models.kimi_linear.model import KimiLinear, KimiLinearArgs
from forja.models.kimi_linear.parallelize import kimi_linear_tp_plan
from forja.models.spec import ModelSpec

_ROUTING = dict(score_func="sigmoid", expert_bias=True, norm_topk_prob=True, route_scale=2.446,
                group_score="top2_sum")

FLAVORS: dict[str, dict] = {
    # ~1.6M parameters: blocks 0-2 KDA, block 3 latent attention; block 0 a dense SwiGLU, the
    # others 8 experts top 2 in 2 groups (1 chosen) and a shared expert.
    "debug": dict(dim=128, n_layers=4, n_heads=4, ffn_dim=384, vocab_size=2048, max_seq_len=2048, norm_eps=1e-5,
                  layer_types=("linear_attention",) * 3 + ("full_attention",), dense_layers=(0,),
                  q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  linear_n_heads=2, linear_head_dim=32, linear_conv_kernel=4,
                  n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, n_expert_groups=2, topk_groups=1,
                  **_ROUTING),
    "48b-a3b": dict(dim=2304, n_layers=27, n_heads=32, ffn_dim=9216, vocab_size=163_840, max_seq_len=1_048_576,
                    norm_eps=1e-5,
                    layer_types=tuple("full_attention" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "linear_attention"
                                      for i in range(27)),
                    dense_layers=(0,), q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, linear_n_heads=32, linear_head_dim=128, linear_conv_kernel=4,
                    n_experts=256, top_k=8, moe_ffn_dim=1024, n_shared_experts=1, n_expert_groups=1, topk_groups=1,
                    **_ROUTING),
}

SPEC = ModelSpec("kimi_linear", KimiLinear, KimiLinearArgs, FLAVORS, ADAPTER, tp_plan=kimi_linear_tp_plan)
