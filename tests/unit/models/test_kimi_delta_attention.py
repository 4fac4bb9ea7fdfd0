"""Kimi Delta Attention: the chunked and recurrent channel-wise delta rule against each other and
against transformers' functions, packed documents (the state reset where a document starts),
the mixer's decoding cache, and the init rules."""

import pytest
import torch

from forja.models.common.attention import AttentionMask, KVCache
from forja.models.common.kimi_delta_attention import KimiDeltaAttention, kimi_delta_init_rule
from forja.models.common.kimi_delta_rule import chunk_kimi_delta_rule, recurrent_kimi_delta_rule

H, D, DV = 3, 8, 6


def _inputs(B=2, T=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=gen)
    g = -2 * torch.rand(B, T, H, D, generator=gen)  # a log decay per key channel, exp(g) in (0.13, 1]
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, D, DV, generator=gen)
    return q, k, v, g, beta, h0


# Measured (fp32, T=37, with an initial state, outputs up to 0.64): chunk 1 / 5 / 16 / 64:
# 1.2e-7 / 8.9e-8 / 1.5e-7 / 2.5e-7 in the outputs, at most 9.5e-7 in the final state.
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_equals_recurrent(chunk_size):
    q, k, v, g, beta, h0 = _inputs()
    o_r, s_r = recurrent_kimi_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = chunk_kimi_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0,
                                     output_final_state=True)
    assert o_c.shape == (2, 37, H, DV) and s_c.shape == (2, H, D, DV)
    assert (o_c - o_r).abs().max() < 2e-6
    assert (s_c - s_r).abs().max() < 2e-6
    assert o_r.abs().max() > 0.1


def test_a_channel_decay_that_is_one_number_per_head_is_the_scalar_rule():
    from forja.models.common.gated_delta_rule import recurrent_gated_delta_rule

    q, k, v, g, beta, h0 = _inputs()
    g = g[..., :1].expand_as(g)  # every channel of a head alike
    o_kda, s_kda = chunk_kimi_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_gdn, s_gdn = recurrent_gated_delta_rule(q, k, v, g[..., 0], beta, initial_state=h0, output_final_state=True)
    assert (o_kda - o_gdn).abs().max() < 2e-6 and (s_kda - s_gdn).abs().max() < 2e-6


def test_matches_transformers_functions():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    q, k, v, g, beta, h0 = _inputs()
    ours, S = chunk_kimi_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in (chunk_kimi_delta_attention, recurrent_kimi_delta_attention):
        theirs, S_theirs = fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        assert (ours - theirs).abs().max() < 2e-6 and (S - S_theirs).abs().max() < 2e-6


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_packed_documents_are_computed_apart(form):
    """A row of three documents (lengths 5, 20, 12: the second crosses chunk boundaries) equals
    each document run alone from a zero state; the row's first document continues h0."""
    q, k, v, g, beta, h0 = _inputs(B=1)
    docs = torch.tensor([[0] * 5 + [1] * 20 + [2] * 12])
    rule = (lambda *a, **kw: chunk_kimi_delta_rule(*a, chunk_size=16, **kw)) if form == "chunked" \
        else recurrent_kimi_delta_rule
    packed, S = rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, document_ids=docs)
    for start, end in ((0, 5), (5, 25), (25, 37)):
        part = [t[:, start:end] for t in (q, k, v, g, beta)]
        alone, S_alone = recurrent_kimi_delta_rule(*part, initial_state=h0 if start == 0 else None,
                                                   output_final_state=True)
        assert (packed[:, start:end] - alone).abs().max() < 2e-6
    assert (S - S_alone).abs().max() < 2e-6  # the row's final state is its last document's


def test_the_mixer_decodes_through_the_cache_as_it_computes_the_whole_sequence():
    torch.manual_seed(0)
    mixer = KimiDeltaAttention(32, n_heads=2, head_dim=8, conv_kernel=4)
    with torch.no_grad():
        mixer.A_log.uniform_(0.0, 1.0)
        mixer.dt_bias.normal_()
    x = torch.randn(2, 21, 32)
    whole = mixer(x, None, AttentionMask())
    cache = KVCache(1, 2, 32, 1, 1, dtype=torch.float32, device="cpu", layers=[])
    steps = [mixer(x[:, :13], None, AttentionMask(), cache, 0)]
    steps += [mixer(x[:, t:t + 1], None, AttentionMask(), cache, 0) for t in range(13, 21)]
    assert (torch.cat(steps, dim=1) - whole).abs().max() < 1e-5


def test_init_rules():
    assert kimi_delta_init_rule("layers.0.attention.A_log") == ("uniform_log", 1.0, 16.0)
    assert kimi_delta_init_rule("layers.0.attention.dt_bias") == ("inv_softplus", 0.001, 0.1, 1e-4)
    assert kimi_delta_init_rule("layers.0.attention.conv_k.weight") == ("uniform", -0.5, 0.5)
    assert kimi_delta_init_rule("layers.0.attention.wq.weight") is None
