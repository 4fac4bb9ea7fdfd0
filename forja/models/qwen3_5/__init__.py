"""Qwen3.5 and Qwen3.5-MoE: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published Qwen3.5 and Qwen3.5-MoE sizes, plus small ones for tests and laptops.

Every released Qwen3.5 shares: 256-wide attention heads of which a quarter rotates (RoPE
base 1e7), Gated DeltaNet in three of every four blocks (16 key heads and 32 value heads
of 128 in the sizes below), a 248,320-token vocabulary and RMSNorm eps 1e-6.
Sources: `9b` is transformers 5.24's Qwen3_5TextConfig defaults (with the published RoPE
base and context); `35b-a3b` is Qwen3_5MoeTextConfig's defaults, which THUDM/slime's
Megatron script for Qwen/Qwen3.5-35B-A3B repeats. Parameter counts: docs/models.md and
tests/unit/models/test_qwen3_5.py (equal to transformers' models built on the meta device).
"""

from forja.models.qwen3_5.hf import ADAPTER
from forja.models.qwen3_5.model import Qwen3_5, Qwen3_5Args
from forja.models.qwen3_5.parallelize import qwen3_5_tp_plan
from forja.models.spec import ModelSpec

_QWEN3_5 = dict(vocab_size=248_320, head_dim=256, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                norm_eps=1e-6, max_seq_len=262_144, linear_n_k_heads=16, linear_n_v_heads=32,
                linear_k_head_dim=128, linear_v_head_dim=128, linear_conv_kernel=4, full_attention_interval=4)

# Tiny shapes share the real ones' ratios: GQA 2:1, value heads twice the key heads, a
# quarter of each head rotating, one full-attention block in four.
_DEBUG = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048, rope_theta=10_000_000.0,
              max_seq_len=2048, linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32)

FLAVORS: dict[str, dict] = {
    # 1.1M parameters: blocks 0-2 Gated DeltaNet, block 3 gated attention.
    "debug": dict(_DEBUG, ffn_dim=384, tie_embeddings=True),
    # 8 experts, top 2, one gated shared expert, in every block.
    "debug-moe": dict(_DEBUG, ffn_dim=0, tie_embeddings=False, n_experts=8, top_k=2, moe_ffn_dim=64,
                      n_shared_experts=1, shared_expert_gate=True, norm_topk_prob=True),
    "9b": dict(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=12288, tie_embeddings=False, **_QWEN3_5),
    "35b-a3b": dict(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, ffn_dim=0, tie_embeddings=False,
                    n_experts=256, top_k=8, moe_ffn_dim=512, n_shared_experts=1, shared_expert_gate=True,
                    norm_topk_prob=True, **_QWEN3_5),
}

SPEC = ModelSpec("qwen3_5", Qwen3_5, Qwen3_5Args, FLAVORS, ADAPTER, tp_plan=qwen3_5_tp_plan)
