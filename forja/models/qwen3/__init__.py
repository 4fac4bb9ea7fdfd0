"""Qwen3 and Qwen3-MoE: `model.py` the model, `hf.py` its checkpoints, the dense TP plan (common/tp_plan.py).

Published Qwen3 and Qwen3-MoE sizes, plus small ones for tests and laptops.

Values are those of the released config.json files (Qwen/Qwen3-0.6B ... Qwen/Qwen3-235B-A22B):
head width 128 at every size, vocabulary of 151,936, RoPE base 1e6, RMSNorm eps 1e-6,
a 40,960-token context, tied embeddings up to 4B. The MoE models route each token to 8 of
128 experts and renormalize the 8 probabilities (`norm_topk_prob: true`); every block is
a mixture of experts (`decoder_sparse_step: 1`, no `mlp_only_layers`), so their dense
`ffn_dim` (`intermediate_size`) builds nothing and is kept only to round-trip config.json.
Parameter counts: docs/models.md and tests/unit/models/test_qwen3.py.
"""

from forja.models.qwen3.hf import ADAPTER
from forja.models.qwen3.model import Qwen3, Qwen3Args
from forja.models.spec import ModelSpec

_QWEN3 = dict(vocab_size=151_936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6, max_seq_len=40_960)
_MOE = dict(n_experts=128, top_k=8, norm_topk_prob=True, score_func="softmax")

FLAVORS: dict[str, dict] = {
    # ~1.2M parameters: unit tests and parity runs. head_dim 64 with dim 128 and 4 heads, so
    # n_heads * head_dim != dim as in the released models.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=384, vocab_size=2048,
                  rope_theta=1_000_000.0, max_seq_len=2048, tie_embeddings=True),
    # ~1.5M parameters, ~1M active: 8 experts, top 2, and one dense block (layer 0) so
    # both kinds of block are exercised.
    "debug-moe": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=2048,
                      rope_theta=1_000_000.0, max_seq_len=2048, tie_embeddings=False,
                      n_experts=8, top_k=2, moe_ffn_dim=64, norm_topk_prob=True, mlp_only_layers=(0,)),
    "0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True, **_QWEN3),
    "1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True, **_QWEN3),
    "4b": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True, **_QWEN3),
    "8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN3),
    "14b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408, **_QWEN3),
    "32b": dict(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600, **_QWEN3),
    "30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, moe_ffn_dim=768,
                    **_MOE, **_QWEN3),
    "235b-a22b": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288, moe_ffn_dim=1536,
                      **_MOE, **_QWEN3),
}

SPEC = ModelSpec("qwen3", Qwen3, Qwen3Args, FLAVORS, ADAPTER)
