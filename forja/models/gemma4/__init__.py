"""Gemma 4 (text): `model.py` the model, `attention.py` its attention and block, `moe.py` its
mixture of experts, `hf.py` its checkpoints, `parallelize.py` its TP plan.

The published Gemma 4 text models (each checkpoint's config.json `text_config`; the vision and
audio towers are not built), plus small ones for tests and laptops. Every total equals
transformers 5.25's Gemma4ForCausalLM built from the same config on the meta device
(tests/unit/models/test_gemma4.py). Shared by all four: GeGLU, head width 256 (512 in the global
blocks), the last block global, a 262,144-token vocabulary, RoPE bases 10,000 (local) and
1,000,000 (global, proportional over a quarter of the frequencies), final logits capped at 30,
tied embeddings.

- "e2b" is google/gemma-4-E2B: 35 blocks, four local to one global, width 1536, 8 query heads
  and one key/value head, GeGLU 6144 wide (12,288 in the 20 shared key/value blocks), per-layer
  embeddings 256 wide, window 512. 4.63B.
- "e4b" is google/gemma-4-E4B: 42 blocks, five local to one global, width 2560, 8 query heads
  and 2 key/value heads (global blocks too), GeGLU 10,240 wide (not doubled in its 18 shared
  key/value blocks: use_double_wide_mlp is false), per-layer embeddings 256 wide, window 512.
  7.46B (the card's "8B" adds the vision and audio towers), 4.64B without the per-layer table
  (the card calls 4.5B "effective").
- "26b-a4b" is google/gemma-4-26B-A4B: 30 blocks, five local to one global, width 2816, 16
  query heads, 8 key/value heads (2 in the global blocks, whose values are their keys), a dense
  GeGLU 2112 wide beside 128 GeGLU experts 704 wide (8 a token), window 1024, no per-layer
  embeddings or shared blocks. 25.23B total, 3.82B active (card: 25.2B, 3.8B).
- "31b" is google/gemma-4-31B: the 26B-A4B's kind of block without experts, 60 blocks, width
  5376, 32 query heads, 16 key/value heads (4 global), GeGLU 21,504 wide. 30.70B (card: 30.7B).

Where the values come from: this machine cannot reach the hub, so the E4B's, 26B-A4B's and
31B's config.json values were read from public code quoting them (ollama's gemma4 config tests
for all three, cross-checked key by key against other inference projects' fixtures and against
the model card's layer counts, windows, expert counts and parameter totals, all of which the
totals above match). Not confirmed from the files themselves: max_position_embeddings
(131,072 for the E models; 262,144 here for the 26B-A4B and 31B, the card's "256K", where one
fixture writes 131,072), which changes no parameter.
"""

from forja.models.gemma4.hf import ADAPTER
from forja.models.gemma4.model import Gemma4, Gemma4Args
from forja.models.gemma4.parallelize import gemma4_tp_plan
from forja.models.spec import ModelSpec

_ROPE = dict(rope_theta=1_000_000.0, local_rope_theta=10_000.0, global_rotary_fraction=0.25)
_FIVE_TO_ONE = ("sliding_attention",) * 5 + ("full_attention",)  # every published size but the E2B's 4 : 1

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
    "e4b": dict(dim=2560, n_layers=42, n_heads=8, n_kv_heads=2, head_dim=256, global_head_dim=512, global_kv_heads=2,
                ffn_dim=10_240, vocab_size=262_144, sliding_window=512, max_seq_len=131_072,
                layer_types=_FIVE_TO_ONE * 7, kv_shared_layers=18, ple_dim=256, ple_vocab_size=262_144,
                final_logit_softcap=30.0, norm_eps=1e-6, tie_embeddings=True, **_ROPE),
    "26b-a4b": dict(dim=2816, n_layers=30, n_heads=16, n_kv_heads=8, head_dim=256, global_head_dim=512,
                    global_kv_heads=2, attention_k_eq_v=True, ffn_dim=2112, n_experts=128, top_k=8, moe_ffn_dim=704,
                    vocab_size=262_144, sliding_window=1024, max_seq_len=262_144, layer_types=_FIVE_TO_ONE * 5,
                    final_logit_softcap=30.0, norm_eps=1e-6, tie_embeddings=True, **_ROPE),
    "31b": dict(dim=5376, n_layers=60, n_heads=32, n_kv_heads=16, head_dim=256, global_head_dim=512, global_kv_heads=4,
                attention_k_eq_v=True, ffn_dim=21_504, vocab_size=262_144, sliding_window=1024, max_seq_len=262_144,
                layer_types=_FIVE_TO_ONE * 10, final_logit_softcap=30.0, norm_eps=1e-6, tie_embeddings=True, **_ROPE),
}

SPEC = ModelSpec("gemma4", Gemma4, Gemma4Args, FLAVORS, ADAPTER, tp_plan=gemma4_tp_plan)
