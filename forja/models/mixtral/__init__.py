"""Mixtral: `model.py` the model, `hf.py` its checkpoints, the dense TP plan (common/tp_plan.py;
its experts split by tokens).

Published Mixtral sizes, plus a small one for tests and laptops.

Values are those of the released config.json files (mistralai/Mixtral-8x7B-v0.1,
mistralai/Mixtral-8x22B-v0.1): 8 experts, top 2, head width 128, 8 key/value heads,
vocabulary of 32,000 (the v0.1 tokenizer; the 8x22B Instruct and v0.3 releases have
32,768), RoPE base 1e6, RMSNorm eps 1e-5, untied embeddings, no sliding window.
Parameter counts: docs/models.md and tests/unit/models/test_mixtral.py.
"""

from forja.models.mixtral.hf import ADAPTER
from forja.models.mixtral.model import Mixtral, MixtralArgs
from forja.models.spec import ModelSpec

_MIXTRAL = dict(n_kv_heads=8, vocab_size=32_000, rope_theta=1_000_000.0, norm_eps=1e-5, n_experts=8, top_k=2)

FLAVORS: dict[str, dict] = {
    # ~1.9M parameters, ~1.0M active: 8 experts of width 96, top 2, GQA 2:1.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=2048,
                  rope_theta=1_000_000.0, norm_eps=1e-5, max_seq_len=2048, n_experts=8, top_k=2),
    "8x7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, max_seq_len=32_768, **_MIXTRAL),
    "8x22b": dict(dim=6144, n_layers=56, n_heads=48, ffn_dim=16384, max_seq_len=65_536, **_MIXTRAL),
}

SPEC = ModelSpec("mixtral", Mixtral, MixtralArgs, FLAVORS, ADAPTER)
