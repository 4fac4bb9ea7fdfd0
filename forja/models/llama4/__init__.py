"""Llama 4, the text model: `model.py` the model, `hf.py` its checkpoints, the dense TP plan
(common/tp_plan.py; a mixture of experts split by tokens).

Published Llama 4 text models, plus a small one for tests and laptops.

Values are those of the released config.json files' text_config (meta-llama/Llama-4-Scout-17B-16E,
meta-llama/Llama-4-Maverick-17B-128E), which transformers' Llama4TextConfig defaults follow for
Scout: width 5120, 48 blocks, 40 query heads of width 128, 8 key/value heads, vocabulary of
202,048, RoPE base 500,000 on three blocks of four (every fourth a NoPE block, global, with
attention temperature tuning: floor 8,192, scale 0.1), rotary blocks chunked by 8,192 tokens,
experts 8,192 wide, one routed expert per token plus the shared one, dense blocks 16,384 wide,
RMSNorm eps 1e-5, untied embeddings. Scout: 16 experts in every block, QK-norm, Llama 3 rope
scaling (factor 16 over 8,192 tokens, both band factors 1), a 10,485,760-token context.
Maverick: 128 experts in every other block (the odd ones), dense blocks between, no QK-norm,
plain RoPE, a 1,048,576-token context. Parameter counts: tests/unit/models/test_llama4.py.
"""

from forja.models.common.rope import RopeScaling
from forja.models.llama4.hf import ADAPTER
from forja.models.llama4.model import Llama4, Llama4Args
from forja.models.spec import ModelSpec

_LLAMA4 = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128, ffn_dim=16384, moe_ffn_dim=8192,
               vocab_size=202_048, top_k=1, rope_theta=500_000.0, norm_eps=1e-5, attention_chunk_size=8192,
               nope_interval=4, floor_scale=8192, attn_scale=0.1)

FLAVORS: dict[str, dict] = {
    # ~1.2M parameters: 4 blocks covering each pairing of (rotary and chunked | NoPE and full)
    # with (dense | experts): rotary-dense, NoPE-MoE, rotary-MoE, NoPE-dense. A 16-token chunk
    # and a temperature floor of 8 positions, so tests of a few dozen tokens see both; 4
    # experts, top 1, and the shared one; Llama 3 rope scaling over an original 64 tokens.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256, moe_ffn_dim=64,
                  vocab_size=2048, max_seq_len=2048, n_experts=4, top_k=1, nope_interval=2, moe_step=2,
                  moe_layers=(1, 2), attention_chunk_size=16, floor_scale=8, attn_scale=0.1,
                  rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_seq_len=64)),
    "scout-17b-16e": dict(**_LLAMA4, n_experts=16, moe_step=1, use_qk_norm=True, max_seq_len=10_485_760,
                          rope_scaling=RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                                                   original_max_seq_len=8192)),
    "maverick-17b-128e": dict(**_LLAMA4, n_experts=128, moe_step=2, use_qk_norm=False, max_seq_len=1_048_576,
                              rope_scaling=None),
}

SPEC = ModelSpec("llama4", Llama4, Llama4Args, FLAVORS, ADAPTER)
