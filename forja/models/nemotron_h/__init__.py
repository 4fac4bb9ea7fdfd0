"""Nemotron-H: `model.py` the model, `hf.py` its checkpoints, `parallelize.py` its TP plan.

Published Nemotron-H sizes, plus a small one for tests and laptops (the pattern strings are
Hugging Face's `hybrid_override_pattern`: M Mamba-2, * attention, - MLP, E mixture of experts).

- `8b` is nvidia/Nemotron-H-8B-Base-8K (transformers' NemotronHConfig defaults): width 4096,
  52 blocks (24 Mamba-2, 4 attention, 24 MLP), attention 32 query and 8 key/value heads of
  128, MLP 21,504, Mamba-2 128 heads of 64 in 8 groups with a 128-wide state, an 8,192-token
  context, a 131,072-token vocabulary, untied embeddings.
- `nano-9b-v2` is nvidia/NVIDIA-Nemotron-Nano-9B-v2: width 4480, 56 blocks (27 Mamba-2, 4
  attention, 25 MLP), 40 query heads and 8 key/value heads of 128, MLP 15,680, Mamba-2 128
  heads of 80 in 8 groups, a 131,072-token context.
- `nano-30b-a3b` is nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B (Nemotron 3 Nano): width 2688, 52
  blocks (23 Mamba-2, 6 attention, 23 mixture-of-experts), 32 query heads and 2 key/value heads
  of 128, Mamba-2 64 heads of 64 in 8 groups with a 128-wide state, experts: 128 routed of
  1,856 (6 a token, weights renormalized and scaled by 2.5) and one shared of 3,712, a
  262,144-token context.
- `super-120b-a12b` is nvidia/NVIDIA-Nemotron-3-Super-120B-A12B (Nemotron 3 Super): width 4096,
  88 blocks (40 Mamba-2, 8 attention, 40 mixture-of-experts), 32 query heads and 2 key/value
  heads of 128, Mamba-2 128 heads of 64 in 8 groups with a 128-wide state, latent experts: 512
  routed of 2,688 computing in a 1,024-wide latent (22 a token, weights renormalized and scaled
  by 5.0), one shared expert of 5,376 on the full width, a 262,144-token context. 120.67B total,
  12.77B active (published: 120B / 12B). Its values were read from public code quoting the
  checkpoint's config.json (NVIDIA's Megatron-Bridge Nemotron3SuperProvider and its training
  scripts, other projects' checks of the released config, one listing its safetensors headers):
  all agree, and the total equals those headers' 123,611,012,096 BF16 weights less the
  2,942,324,736 of the multi-token prediction block. That block (`mtp_hybrid_override_pattern`
  "*E") is not built here, as transformers builds none; `intermediate_size`, which no block of
  this pattern reads, is set to the experts' width.

Parameter counts: tests/unit/models/test_nemotron_h.py (equal to transformers' model built on
the meta device).
"""

from forja.models.nemotron_h.hf import ADAPTER
from forja.models.nemotron_h.model import NemotronH, NemotronHArgs, nemotron_h_layer_types
from forja.models.nemotron_h.parallelize import nemotron_h_tp_plan
from forja.models.spec import ModelSpec

_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_NANO_9B_V2 = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
_NANO_30B_A3B = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_SUPER_120B_A12B = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"

FLAVORS: dict[str, dict] = {
    # ~1.2M parameters: three Mamba-2 blocks (8 heads of 32 in 2 groups, a 16-wide state,
    # 32-token chunks), two MLP blocks, one attention block (4 query, 2 key/value heads) and
    # one mixture of experts (8 routed experts of 64, 2 a token, scaled by 2.5, and a shared
    # one of 128).
    "debug": dict(dim=128, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=2048,
                  max_seq_len=2048, layer_types=nemotron_h_layer_types("M-M*-ME"), mamba_n_heads=8,
                  mamba_head_dim=32, mamba_n_groups=2, mamba_state_size=16, mamba_chunk_size=32,
                  n_experts=8, top_k=2, moe_ffn_dim=64, shared_ffn_dim=128, route_scale=2.5),
    "8b": dict(dim=4096, n_layers=52, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=21_504, vocab_size=131_072,
               max_seq_len=8192, layer_types=nemotron_h_layer_types(_8B), mamba_n_heads=128, mamba_head_dim=64,
               mamba_n_groups=8, mamba_state_size=128),
    "nano-9b-v2": dict(dim=4480, n_layers=56, n_heads=40, n_kv_heads=8, head_dim=128, ffn_dim=15_680,
                       vocab_size=131_072, max_seq_len=131_072, layer_types=nemotron_h_layer_types(_NANO_9B_V2),
                       mamba_n_heads=128, mamba_head_dim=80, mamba_n_groups=8, mamba_state_size=128),
    "nano-30b-a3b": dict(dim=2688, n_layers=52, n_heads=32, n_kv_heads=2, head_dim=128, ffn_dim=1856,
                         vocab_size=131_072, max_seq_len=262_144, layer_types=nemotron_h_layer_types(_NANO_30B_A3B),
                         mamba_n_heads=64, mamba_head_dim=64, mamba_n_groups=8, mamba_state_size=128,
                         n_experts=128, top_k=6, moe_ffn_dim=1856, shared_ffn_dim=3712, route_scale=2.5),
    "super-120b-a12b": dict(dim=4096, n_layers=88, n_heads=32, n_kv_heads=2, head_dim=128, ffn_dim=2688,
                            vocab_size=131_072, max_seq_len=262_144,
                            layer_types=nemotron_h_layer_types(_SUPER_120B_A12B), mamba_n_heads=128,
                            mamba_head_dim=64, mamba_n_groups=8, mamba_state_size=128, n_experts=512, top_k=22,
                            moe_ffn_dim=2688, shared_ffn_dim=5376, route_scale=5.0, moe_latent_dim=1024),
}

SPEC = ModelSpec("nemotron_h", NemotronH, NemotronHArgs, FLAVORS, ADAPTER, tp_plan=nemotron_h_tp_plan)
