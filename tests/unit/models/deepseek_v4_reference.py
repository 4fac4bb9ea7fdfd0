"""Shared by the DeepSeek-V4 mechanism tests: a tiny transformers config and random weights."""

from __future__ import annotations

import torch


def tiny_config(**overrides):
    from transformers import DeepseekV4Config

    fields = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, head_dim=16, q_lora_rank=16,
                  partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
                  index_topk=3, sliding_window=6, hc_mult=3, hc_sinkhorn_iters=5, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3, swiglu_limit=0.5,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                  compress_rope_theta=1000.0, rope_theta=100.0)
    fields.update(overrides)
    config = DeepseekV4Config(**fields)
    config._attn_implementation = "eager"
    return config


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.5) -> None:
    """Every floating parameter and buffer of `module` drawn N(0, std^2) (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std
            p.copy_(noise + (1.0 if name.endswith("norm.weight") else 0.0))


# transformers' DeepSeek-V4 attention names -> forja's (forja/models/common/compressed_attention.py).
ATTENTION_RENAMES = (
    ("compressor.indexer.", "indexer."),
    ("indexer.kv_proj.", "indexer.compressor.wkv."), ("indexer.gate_proj.", "indexer.compressor.wgate."),
    ("indexer.position_bias", "indexer.compressor.position_bias"), ("indexer.kv_norm.", "indexer.compressor.norm."),
    ("indexer.q_b_proj.", "indexer.wq_b."), ("indexer.scorer.weights_proj.", "indexer.weights_proj."),
    ("compressor.kv_proj.", "compressor.wkv."), ("compressor.gate_proj.", "compressor.wgate."),
    ("compressor.kv_norm.", "compressor.norm."), ("q_a_proj.", "wq_a."), ("q_a_norm.", "q_norm."),
    ("q_b_proj.", "wq_b."), ("kv_proj.", "wkv."), ("o_a_proj.weight", "wo.wo_a"), ("o_b_proj.", "wo.wo_b."),
)


def renamed(state: dict, renames=ATTENTION_RENAMES, prefix: str = "") -> dict:
    """`state` with `prefix` added to each key, then each rename applied in turn."""
    out = {}
    for key, value in state.items():
        new = prefix + key
        for old, repl in renames:
            if old in new:
                new = new.replace(old, repl, 1)
        out[new] = value
    return out


def sliding_mask(T: int, window: int, offset: int = 0, dtype=torch.float32) -> torch.Tensor:
    """transformers' eager additive mask (1, 1, T, offset + T): causal within the window."""
    q = torch.arange(offset, offset + T)[:, None]
    k = torch.arange(offset + T)[None, :]
    allowed = (q >= k) & (q - k < window)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
