"""OLMo-Hybrid: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

The published OLMo-Hybrid size, plus a small one for tests and laptops.

`7b` is allenai/Olmo-Hybrid-7B, the checkpoint transformers 5.24's OlmoHybridConfig names,
with that config's defaults (no config.json was read): width 3840, 32 blocks in the pattern
Gated DeltaNet x 3 then attention, 30 attention heads (no grouping) and 30 Gated DeltaNet
heads of 96 (keys) and 192 (values), SwiGLU 11,008, a 100,352-token vocabulary, untied
embeddings, RMSNorm eps 1e-6, a 65,536-token context, allow_neg_eigval. One exception:
positions. The config's default RoPE base is 10,000, but transformers' OlmoHybridModel
says the released checkpoints use no RoPE (rope_theta None); the flavor follows the
checkpoint (rope_theta=None; set model.rope_theta to rotate). Parameter counts:
docs/models.md and tests/unit/models/test_olmo_hybrid.py (equal to transformers' model
built on the meta device).
"""

from forja.models.olmo_hybrid.hf import ADAPTER
from forja.models.olmo_hybrid.model import OlmoHybrid, OlmoHybridArgs, olmo_hybrid_layer_types
from forja.models.olmo_hybrid.parallelize import olmo_hybrid_tp_plan
from forja.models.spec import ModelSpec

FLAVORS: dict[str, dict] = {
    # ~1.3M parameters: blocks 0-2 Gated DeltaNet, block 3 attention, as the 7B's first four.
    # The 7B's ratios: linear heads = attention heads, key heads 0.75 dim / heads wide, value
    # heads twice that.
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, vocab_size=2048, max_seq_len=2048,
                  norm_eps=1e-6, rope_theta=None, layer_types=olmo_hybrid_layer_types(4), tie_embeddings=False,
                  linear_n_k_heads=4, linear_n_v_heads=4, linear_k_head_dim=24, linear_v_head_dim=48),
    "7b": dict(dim=3840, n_layers=32, n_heads=30, n_kv_heads=30, ffn_dim=11_008, vocab_size=100_352,
               max_seq_len=65_536, norm_eps=1e-6, rope_theta=None, layer_types=olmo_hybrid_layer_types(32),
               tie_embeddings=False, linear_n_k_heads=30, linear_n_v_heads=30, linear_k_head_dim=96,
               linear_v_head_dim=192, linear_conv_kernel=4, linear_allow_neg_eigval=True),
}

SPEC = ModelSpec("olmo_hybrid", OlmoHybrid, OlmoHybridArgs, FLAVORS, ADAPTER, tp_plan=olmo_hybrid_tp_plan)
