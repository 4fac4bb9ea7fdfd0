"""gpt-oss: `model.py` the model, `hf.py` its checkpoints, the dense TP plan (common/tp_plan.py;
sinks sharded with the heads, experts split by tokens).

Published gpt-oss sizes, plus a small one for tests and laptops.

Values are those of the released config.json files (openai/gpt-oss-20b, openai/gpt-oss-120b)
and transformers' GptOssConfig defaults: width 2880, 64 query heads of width 64 (so
n_heads * head_dim = 4096 != dim), 8 key/value heads, experts 2880 wide, top 4, vocabulary
of 201,088 (o200k_harmony), a 128-token sliding window on every other block (sliding
first), RoPE base 150,000 with YaRN (factor 32 over 4,096 tokens, to a 131,072-token
context), RMSNorm eps 1e-5, untied embeddings. 20b: 24 blocks, 32 experts; 120b: 36
blocks, 128 experts. Parameter counts: docs/models.md and tests/unit/models/test_gpt_oss.py.
"""

from forja.models.common.rope import YarnScaling
from forja.models.gpt_oss.hf import ADAPTER
from forja.models.gpt_oss.model import GptOss, GptOssArgs
from forja.models.spec import ModelSpec

_GPT_OSS = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880, vocab_size=201_088, top_k=4,
                sliding_window=128, rope_theta=150_000.0, norm_eps=1e-5, max_seq_len=131_072)

FLAVORS: dict[str, dict] = {
    # ~2.5M parameters: 4 blocks (sliding, full, sliding, full) with an 8-token window, so
    # tests of a few dozen tokens see it; sinks; 8 experts, top 2; head_dim 64 with dim 128
    # (n_heads * head_dim != dim, as released); YaRN over an original 64-token context.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=96, vocab_size=2048,
                  sliding_window=8, rope_theta=150_000.0, max_seq_len=2048, n_experts=8, top_k=2,
                  rope_scaling=YarnScaling(factor=32.0, original_max_seq_len=64, beta_fast=32.0, beta_slow=1.0,
                                           truncate=False)),
    "20b": dict(n_layers=24, n_experts=32, **_GPT_OSS),
    "120b": dict(n_layers=36, n_experts=128, **_GPT_OSS),
}

SPEC = ModelSpec("gpt_oss", GptOss, GptOssArgs, FLAVORS, ADAPTER)
