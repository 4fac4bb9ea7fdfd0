"""Llama 3: `model.py` the model, `hf.py` its checkpoints, the dense TP plan (common/tp_plan.py).

Published Llama 3 sizes, plus small ones for tests and laptops.

Values are those of Meta's released configs (dim, layers, heads, kv heads, FFN width,
RoPE base and scaling, vocabulary of 128,256, 131,072-token context for 3.1/3.2).
"""

from forja.models.common.rope import RopeScaling
from forja.models.llama.hf import ADAPTER
from forja.models.llama.model import Llama, LlamaArgs, llama_tp_plan
from forja.models.spec import ModelSpec

_LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA32_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, norm_eps=1e-5, max_seq_len=131_072)

FLAVORS: dict[str, dict] = {
    # ~1M parameters: unit tests and parity runs.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=2048,
                  rope_theta=10_000.0, max_seq_len=2048, tie_embeddings=True),
    # ~10M parameters: `forja train`'s default, minutes on a laptop CPU.
    "tiny": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=8192,
                 rope_theta=10_000.0, max_seq_len=2048, tie_embeddings=False),
    "3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                   rope_scaling=RopeScaling(**_LLAMA32_SCALING), **_LLAMA3),
    "3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                   rope_scaling=RopeScaling(**_LLAMA32_SCALING), **_LLAMA3),
    "3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                   rope_scaling=RopeScaling(**_LLAMA31_SCALING), **_LLAMA3),
    "3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                    rope_scaling=RopeScaling(**_LLAMA31_SCALING), **_LLAMA3),
    "3.1-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                     rope_scaling=RopeScaling(**_LLAMA31_SCALING), **_LLAMA3),
}

SPEC = ModelSpec("llama", Llama, LlamaArgs, FLAVORS, ADAPTER, tp_plan=llama_tp_plan)
