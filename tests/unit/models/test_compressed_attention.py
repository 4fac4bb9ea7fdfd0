"""DeepSeek-V4's attention (forja/models/common/compressed_attention.py) and its grouped
low-rank output projection (grouped_output.py) against transformers' modules on random weights:
each kind of block (sliding window, HCA, CSA) on a whole prefill, then on a prefill continued
token by token and by a chunk through forja's KV cache and transformers' DynamicCache."""

from __future__ import annotations

import pytest
import torch

from forja.models.common.attention import AttentionMask, KVCache
from forja.models.common.compressed_attention import CompressedAttention
from forja.models.common.grouped_output import GroupedLowRankOutput
from tests.unit.models.deepseek_v4_reference import randomize, renamed, tiny_config


def test_grouped_output_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    a = DeepseekV4GroupedLinear(12, 3 * 5, 3)
    b = torch.nn.Linear(15, 7, bias=False)
    randomize(a, 1), randomize(b, 2)
    ours = GroupedLowRankOutput(36, 7, groups=3, rank=5)
    ours.load_state_dict({"wo_a": a.weight, "wo_b.weight": b.weight})
    x = torch.randn(2, 4, 36)
    expected = b(a(x.view(2, 4, 3, 12)).flatten(2))
    assert (ours(x) - expected).abs().max() < 1e-6


def _pair(kind: str, **overrides):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    config = tiny_config(layer_types=[kind] * 3, **overrides)
    ref = DeepseekV4Attention(config, 0)
    randomize(ref, seed=5)
    rotary = DeepseekV4RotaryEmbedding(config)
    ratio = config.compress_rates.get(kind, 0)
    ours = CompressedAttention(config.hidden_size, config.num_attention_heads, config.head_dim, kind=kind,
                               q_lora_rank=config.q_lora_rank, o_groups=config.o_groups,
                               o_lora_rank=config.o_lora_rank, inv_freq=rotary.compress_inv_freq.clone(),
                               ratio=ratio, index_n_heads=config.index_n_heads,
                               index_head_dim=config.index_head_dim, index_topk=config.index_topk,
                               eps=config.rms_norm_eps)
    ours.load_state_dict(renamed(ref.state_dict()))
    return config, ref, rotary, ours


def _ref_call(ref, rotary, config, x, start, kept, cache):
    T = x.shape[1]
    pos = torch.arange(start, start + T)[None]
    emb = {k: rotary(x, pos, layer_type=k) for k in ("main", "compress")}
    q = torch.arange(start, start + T)[:, None]
    k = torch.arange(start - kept, start + T)[None, :]
    allowed = (q >= k) & (q - k < config.sliding_window)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    mask = mask.expand(x.shape[0], -1, -1, -1)
    return ref(x, emb, pos, mask, cache)[0], emb[ref.rope_layer_type]


def _ours_call(ours, config, x, start, emb, cache):
    T = x.shape[1]
    q = torch.arange(start, start + T)[:, None]
    k = torch.arange(start + T)[None, :]
    allowed = ((q >= k) & (q - k < config.sliding_window))[None, None]
    mask = AttentionMask(dense=allowed, positions=torch.arange(start, start + T))
    out = ours(x, (emb[0][0], emb[1][0]), mask, cache, 0)
    if cache is not None:
        cache.advance(T)
    return out


@pytest.mark.parametrize("kind", ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"])
def test_attention_matches_transformers(kind):
    from transformers import DynamicCache

    config, ref, rotary, ours = _pair(kind)
    T = 22
    x = torch.randn(2, T, config.hidden_size)
    with torch.no_grad():
        expected, emb = _ref_call(ref, rotary, config, x, 0, 0, None)
        assert (_ours_call(ours, config, x, 0, emb, None) - expected).abs().max() < 1e-5
        cache, kv = DynamicCache(config=config), KVCache(1, 2, T, 1, config.head_dim, dtype=x.dtype, device="cpu",
                                                           value_dim=1)
        start = 0
        for n in (9, 1, 1, 1, 3, 1, 6):
            part = x[:, start:start + n]
            r, emb = _ref_call(ref, rotary, config, part, start, min(start, config.sliding_window - 1), cache)
            assert (_ours_call(ours, config, part, start, emb, kv) - r).abs().max() < 1e-5
            start += n
