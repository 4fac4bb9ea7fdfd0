"""OLMo 2: `model.py` the model, `hf.py` its checkpoints; its TP plan is OLMo 3's.

Published OLMo 2 sizes, plus a small one for tests and laptops. Values are those of the
released config.json files (allenai/OLMo-2-0425-1B, OLMo-2-1124-7B, OLMo-2-1124-13B,
OLMo-2-0325-32B): vocabulary of 100,352 (the dolma2 tokenizer, padded), RMSNorm eps 1e-6,
untied embeddings, RoPE base 500,000, a 4,096-token context. The 32B groups 40 query heads
over 8 key/value heads; the others have as many as query heads.
Parameter counts: docs/models.md and tests/unit/models/test_olmo2.py.
"""

from forja.models.olmo2.hf import ADAPTER
from forja.models.olmo2.model import Olmo2, Olmo2Args
from forja.models.olmo3.parallelize import olmo3_tp_plan
from forja.models.spec import ModelSpec

_OLMO2 = dict(vocab_size=100_352, norm_eps=1e-6, rope_theta=500_000.0, max_seq_len=4096, tie_embeddings=False)

FLAVORS: dict[str, dict] = {
    # ~1.3M parameters: unit tests and parity runs; grouped-query attention 2:1.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=2048, norm_eps=1e-6,
                  rope_theta=500_000.0, max_seq_len=2048, tie_embeddings=False),
    "1b": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=8192, **_OLMO2),
    "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11_008, **_OLMO2),
    "13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13_824, **_OLMO2),
    "32b": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27_648, **_OLMO2),
}

SPEC = ModelSpec("olmo2", Olmo2, Olmo2Args, FLAVORS, ADAPTER, tp_plan=olmo3_tp_plan)
