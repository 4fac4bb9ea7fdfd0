"""Gemma 3 (text): `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published Gemma 3 text-model sizes, plus a small one for tests and laptops.

Values are those of the released config.json files (google/gemma-3-270m, -1b-pt, and the
text_config of -4b-pt, -12b-pt, -27b-pt): five local blocks to one global one, RMSNorm eps
1e-6, tied embeddings, head width 256 (128 in the 27B, whose query_pre_attn_scalar is
dim / n_heads = 168), local RoPE base 10,000 and global 1,000,000, the global one scaled
linearly by 8 in the models with a 128K context. The 270M and 1B have a 262,144-token
vocabulary and a window of 512; the larger ones 262,208 (image tokens) and 1024.
Parameter counts: docs/models.md and tests/unit/models/test_gemma3.py.
"""

from forja.models.gemma3.hf import ADAPTER
from forja.models.gemma3.model import Gemma3, Gemma3Args, gemma3_layer_types
from forja.models.gemma3.parallelize import gemma3_tp_plan
from forja.models.spec import ModelSpec

_GEMMA3 = dict(norm_eps=1e-6, tie_embeddings=True, head_dim=256, query_pre_attn_scalar=256,
               rope_theta=1_000_000.0, local_rope_theta=10_000.0)
_SMALL = dict(vocab_size=262_144, sliding_window=512, max_seq_len=32_768, rope_linear_factor=1.0, **_GEMMA3)
_LARGE = dict(vocab_size=262_208, sliding_window=1024, max_seq_len=131_072, rope_linear_factor=8.0, **_GEMMA3)

FLAVORS: dict[str, dict] = {
    # ~1.4M parameters: unit tests and parity runs. Six blocks (one global after five local),
    # a window of 8 so a test's sequences are longer than it, query_pre_attn_scalar 48 !=
    # head_dim 32 so the scale is seen.
    "debug": dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=2048,
                  query_pre_attn_scalar=48, sliding_window=8, layer_types=gemma3_layer_types(6), max_seq_len=2048,
                  norm_eps=1e-6, tie_embeddings=True, rope_theta=1_000_000.0, local_rope_theta=10_000.0),
    "270m": dict(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, ffn_dim=2048, layer_types=gemma3_layer_types(18),
                 **_SMALL),
    "1b": dict(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_dim=6912, layer_types=gemma3_layer_types(26),
               **_SMALL),
    "4b": dict(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_dim=10_240, layer_types=gemma3_layer_types(34),
               **_LARGE),
    "12b": dict(dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_dim=15_360,
                layer_types=gemma3_layer_types(48), **_LARGE),
    "27b": dict(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, ffn_dim=21_504,
                layer_types=gemma3_layer_types(62), **{**_LARGE, "head_dim": 128, "query_pre_attn_scalar": 168}),
}

SPEC = ModelSpec("gemma3", Gemma3, Gemma3Args, FLAVORS, ADAPTER, tp_plan=gemma3_tp_plan)
