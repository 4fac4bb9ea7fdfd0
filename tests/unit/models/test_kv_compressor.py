"""KV compression and the compressed lightning indexer (forja/models/common/kv_compressor.py)
against transformers' DeepSeek-V4 compressors on random weights: HCA's disjoint windows, CSA's
overlapping ones, the indexer's picks, whole prefills and a prefill continued piece by piece."""

from __future__ import annotations

import pytest
import torch

from forja.models.common.kv_compressor import CompressedIndexer, CompressorState, KVCompressor, rotate_tail
from tests.unit.models.deepseek_v4_reference import randomize, renamed, tiny_config


def _inv_freq(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    return DeepseekV4RotaryEmbedding(config).compress_inv_freq.clone()


def _compressor(kind: str, config):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    csa = kind == "compressed_sparse_attention"
    ref = (m.DeepseekV4CSACompressor if csa else m.DeepseekV4HCACompressor)(config)
    randomize(ref, seed=3)
    ratio = config.compress_rates[kind]
    ours = KVCompressor(config.hidden_size, config.head_dim, ratio, _inv_freq(config), overlap=csa,
                        eps=config.rms_norm_eps)
    state = {k.removeprefix("compressor."): v for k, v in renamed(ref.state_dict(), prefix="compressor.").items()
             if "indexer" not in k}
    ours.load_state_dict(state)
    return ref, ours


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    x = torch.randn(2, 3, 5, 16)  # (B, H, T, D)
    cos, sin = torch.randn(5, 4), torch.randn(5, 4)
    assert (rotate_tail(x, cos, sin) - apply_rotary_pos_emb(x, cos[None], sin[None])).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ["heavily_compressed_attention", "compressed_sparse_attention"])
def test_compressed_entries_match_transformers(kind):
    from transformers import DynamicCache

    config = tiny_config(layer_types=[kind] * 3)
    ref, ours = _compressor(kind, config)
    x = torch.randn(2, 21, config.hidden_size)
    q_res = torch.randn(2, 21, config.q_lora_rank)
    with torch.no_grad():
        expected, _ = ref(x, q_res, torch.arange(21)[None], None, 0)  # (B, 1, N, hd)
        assert (ours(x) - expected[:, 0]).abs().max() < 1e-5
        # The same sequence in pieces (prefill 7, then 1, 5, 8 tokens) through each one's state.
        cache, state, start = DynamicCache(config=config), CompressorState(), 0
        for n in (7, 1, 5, 8):
            part = slice(start, start + n)
            r, _ = ref(x[:, part], q_res[:, part], torch.arange(start, start + n)[None], cache, 0)
            got = ours(x[:, part], state)
            assert got.shape == r[:, 0].shape and float(
                (got - r[:, 0]).abs().sum()) < 1e-4
            start += n
        assert (state.entries - expected[:, 0]).abs().max() < 1e-5


def test_indexer_picks_match_transformers():
    from transformers import DynamicCache
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer, DeepseekV4RotaryEmbedding

    config = tiny_config(layer_types=["compressed_sparse_attention"] * 3, index_n_heads=4, index_topk=2)
    ref = DeepseekV4Indexer(config)
    randomize(ref, seed=4)
    ours = CompressedIndexer(config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim,
                             4, config.index_topk, _inv_freq(config), eps=config.rms_norm_eps)
    state = renamed(ref.state_dict(), prefix="indexer.")
    ours.load_state_dict({k.removeprefix("indexer."): v for k, v in state.items()})
    rotary = DeepseekV4RotaryEmbedding(config)
    T = 23
    x, q_res = torch.randn(2, T, config.hidden_size), torch.randn(2, T, config.q_lora_rank)
    with torch.no_grad():
        expected = ref(x, q_res, torch.arange(T)[None], None, 0)
        cos, sin = rotary(x, torch.arange(T)[None], layer_type="compress")
        picks = ours(x, q_res, torch.arange(T), (cos[0], sin[0]))
        assert torch.equal(picks.sort(-1).values, expected.sort(-1).values)
        cache, state, start = DynamicCache(config=config), CompressorState(), 0
        for n in (9, 1, 1, 4):
            part, pos = slice(start, start + n), torch.arange(start, start + n)
            r = ref(x[:, part], q_res[:, part], pos[None], cache, 0)
            cos, sin = rotary(x, pos[None], layer_type="compress")
            o = ours(x[:, part], q_res[:, part], pos, (cos[0], sin[0]), state)
            assert torch.equal(o.sort(-1).values, r.sort(-1).values)
            start += n
