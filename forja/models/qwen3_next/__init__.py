"""Qwen3-Next: `model.py` the model, `hf.py` its checkpoints, Qwen3.5's TP plan (its blocks are the same modules).

Published Qwen3-Next sizes, plus a small one for tests and laptops.

`80b-a3b` is Qwen/Qwen3-Next-80B-A3B (Base, Instruct and Thinking share the shape): 48
blocks, Gated DeltaNet in three of every four (16 key heads, 32 value heads of 128), gated
attention with 16 query heads and 2 key/value heads of 256 in the fourth, a quarter of
each head rotating (RoPE base 1e7), every block a mixture of 512 experts of width 512
with 10 chosen per token plus one gated shared expert of 512, a 151,936-token vocabulary.
Its `intermediate_size` (5120) sizes no block (none is dense) but is kept, so an export
writes the published config. Parameter counts: docs/models.md and
tests/unit/models/test_qwen3_next.py (equal to transformers' model built on the meta device).
"""

from forja.models.qwen3_5.parallelize import qwen3_5_tp_plan
from forja.models.qwen3_next.hf import ADAPTER
from forja.models.qwen3_next.model import Qwen3Next, Qwen3NextArgs
from forja.models.spec import ModelSpec

FLAVORS: dict[str, dict] = {
    # ~1.5M parameters: blocks 0-2 Gated DeltaNet, block 3 gated attention; block 1 a dense
    # SwiGLU (mlp_only_layers), the others 8 experts top 2 and a gated shared expert (the
    # MTP block, with model.mtp.depth = 1, too: it follows block 0).
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048,
                  rope_theta=10_000_000.0, max_seq_len=2048, linear_n_k_heads=2, linear_n_v_heads=4,
                  linear_k_head_dim=32, linear_v_head_dim=32, ffn_dim=256, tie_embeddings=False,
                  n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, shared_expert_gate=True,
                  norm_topk_prob=True, mlp_only_layers=(1,)),
    "80b-a3b": dict(dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, ffn_dim=5120,
                    vocab_size=151_936, rope_theta=10_000_000.0, partial_rotary_factor=0.25, norm_eps=1e-6,
                    max_seq_len=262_144, tie_embeddings=False, full_attention_interval=4,
                    linear_n_k_heads=16, linear_n_v_heads=32, linear_k_head_dim=128, linear_v_head_dim=128,
                    linear_conv_kernel=4, n_experts=512, top_k=10, moe_ffn_dim=512, n_shared_experts=1,
                    shared_expert_gate=True, norm_topk_prob=True),
}

SPEC = ModelSpec("qwen3_next", Qwen3Next, Qwen3NextArgs, FLAVORS, ADAPTER, tp_plan=qwen3_5_tp_plan)
