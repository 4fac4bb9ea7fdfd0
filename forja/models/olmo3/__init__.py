"""OLMo 3: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published OLMo 3 sizes, plus a small one for tests and laptops.

Values are those of the released config.json files (allenai/Olmo-3-1025-7B and
allenai/Olmo-3-1125-32B): vocabulary of 100,278 (the dolma2 tokenizer), RMSNorm eps 1e-6,
untied embeddings, RoPE base 500,000, a sliding window of 4096 in three blocks of four,
a 65,536-token context reached by YaRN (factor 8 over the 8,192-token pre-training context,
attention factor 1.2079) on the full-attention blocks. The 7B has as many key/value heads
as query heads; the 32B groups 40 query heads over 8.
Parameter counts: docs/models.md and tests/unit/models/test_olmo3.py.
"""

from forja.models.olmo3.hf import ADAPTER
from forja.models.olmo3.model import Olmo3, Olmo3Args, olmo3_layer_types
from forja.models.olmo3.parallelize import olmo3_tp_plan
from forja.models.spec import ModelSpec

_YARN = dict(factor=8.0, original_max_seq_len=8192, beta_fast=32.0, beta_slow=1.0,
             attention_factor=1.2079441541679836)
_OLMO3 = dict(vocab_size=100_278, norm_eps=1e-6, rope_theta=500_000.0, local_rope_theta=500_000.0,
              sliding_window=4096, max_seq_len=65_536, tie_embeddings=False, rope_scaling=_YARN)

FLAVORS: dict[str, dict] = {
    # ~1.3M parameters: unit tests and parity runs. A window of 8 so a test's sequences are
    # longer than it; the 3:1 pattern over 4 blocks; grouped-query attention 2:1.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=2048, norm_eps=1e-6,
                  rope_theta=500_000.0, local_rope_theta=500_000.0, sliding_window=8,
                  layer_types=olmo3_layer_types(4), max_seq_len=2048, tie_embeddings=False),
    "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11_008,
               layer_types=olmo3_layer_types(32), **_OLMO3),
    "32b": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27_648,
                layer_types=olmo3_layer_types(64), **_OLMO3),
}

SPEC = ModelSpec("olmo3", Olmo3, Olmo3Args, FLAVORS, ADAPTER, tp_plan=olmo3_tp_plan)
