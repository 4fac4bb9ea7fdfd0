"""Gemma 4 (text): `model.py` the model, `attention.py` its attention and block, `moe.py` its
mixture of experts, `hf.py` its checkpoints, `parallelize.py` its TP plan.

The published Gemma 4 text model forja is sure of, plus a small one for tests and laptops.

"e2b" is the text model of google/gemma-4-E2B (its config.json's text_config): 35 blocks, four
local to one global, width 1536, 8 query heads and one key/value head of width 256 (512 in
the global blocks), GeGLU 6144 wide (12,288 in the 20 shared key/value blocks), per-layer
embeddings 256 wide over the 262,144-token vocabulary, window 512, RoPE bases 10,000 (local)
and 1,000,000 (global, proportional over a quarter of the frequencies), final logits capped at
30, tied embeddings. Parameter counts: tests/unit/models/test_gemma4.py.

No other size is here: the installed transformers (5.25) names google/gemma-4-26B-A4B only in
a comment and carries no config of it, nor of the E4B or 31B; their widths are not on this
machine to be checked, so they are not guessed.
"""

from forja.models.gemma4.hf import ADAPTER
from forja.models.gemma4.model import Gemma4, Gemma4Args
from forja.models.gemma4.parallelize import gemma4_tp_plan
from forja.models.spec import ModelSpec

_ROPE = dict(rope_theta=1_000_000.0, local_rope_theta=10_000.0, global_rotary_fraction=0.25)

# ~1.6M parameters exercising every mechanism forja's Gemma 4 has: local blocks of 4 heads
# of 32, global ones of 2 key/value heads of 64 with values = keys (attention_k_eq_v) and
# RoPE on a quarter of their frequencies, the last two blocks (one of each kind) sharing keys
# and values with double-wide MLPs, per-layer embeddings 16 wide, a window of 8 so a test's
# sequences are longer than it, logits capped at 30.
_DEBUG = dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=4, head_dim=32, global_head_dim=64, global_kv_heads=2,
              attention_k_eq_v=True, ffn_dim=256, vocab_size=2048, sliding_window=8, max_seq_len=2048,
              layer_types=("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"),
              kv_shared_layers=2, double_wide_mlp=True, ple_dim=16, ple_vocab_size=2048,
              final_logit_softcap=30.0, norm_eps=1e-6, tie_embeddings=True, **_ROPE)

FLAVORS: dict[str, dict] = {
    "debug": _DEBUG,
    # ~2.9M parameters: "debug" with the 26B-A4B's kind of block, 8 GeGLU experts 64 wide beside
    # every dense MLP, each token routed to 2 (softmax, renormalized, then per-expert scales).
    "debug-moe": dict(_DEBUG, n_experts=8, top_k=2, moe_ffn_dim=64),
    "e2b": dict(dim=1536, n_layers=35, n_heads=8, n_kv_heads=1, head_dim=256, global_head_dim=512, global_kv_heads=1,
                ffn_dim=6144, vocab_size=262_144, sliding_window=512, max_seq_len=131_072,
                layer_types=(("sliding_attention",) * 4 + ("full_attention",)) * 7,
                kv_shared_layers=20, double_wide_mlp=True, ple_dim=256, ple_vocab_size=262_144,
                final_logit_softcap=30.0, norm_eps=1e-6, tie_embeddings=True, **_ROPE),
}

SPEC = ModelSpec("gemma4", Gemma4, Gemma4Args, FLAVORS, ADAPTER, tp_plan=gemma4_tp_plan)
