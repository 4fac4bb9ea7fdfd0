"""Gated DeltaNet: the chunked and recurrent gated delta rule against each other and against
transformers' functions; the mixer against transformers' Qwen3.5 and OLMo-Hybrid layers;
packed documents, the decoding cache, gradients and the init rules."""

import math

import pytest
import torch
import torch.nn.functional as F

from forja.models import build_model
from forja.models.common.attention import AttentionMask, KVCache
from forja.models.common.gated_delta_rule import (
    chunk_gated_delta_rule,
    fla_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from forja.models.common.gated_deltanet import GatedDeltaNet, causal_conv, gated_deltanet_init_rule
from forja.models.common.init import init_parameters

transformers = pytest.importorskip("transformers")

DIM, HK, HV, DK, DV, K = 32, 2, 4, 8, 6, 4


def _inputs(B=2, T=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, DV, generator=gen)
    g = -2 * torch.rand(B, T, HV, generator=gen)  # log decay, exp(g) in (0.13, 1]
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, DK, DV, generator=gen)
    return q, k, v, g, beta, h0


# Measured (fp32, T=37, 2:1 grouped heads, with an initial state, outputs up to 0.67): chunked
# vs recurrent, chunk 1 / 5 / 16 / 64: 6.3e-8 / 8.9e-8 / 1.8e-7 / 2.4e-7 in the outputs, at most
# 8.0e-7 in the final state.
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_equals_recurrent(chunk_size):
    q, k, v, g, beta, h0 = _inputs()
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0,
                                      output_final_state=True)
    assert o_c.shape == (2, 37, HV, DV) and s_c.shape == (2, HV, DK, DV)
    assert (o_c - o_r).abs().max() < 2e-6
    assert (s_c - s_r).abs().max() < 2e-6
    assert o_r.abs().max() > 0.1  # not a trivially small output


# Measured against transformers' torch_chunk_gated_delta_rule (chunk 16) and
# torch_recurrent_gated_delta_rule, use_qk_l2norm_in_kernel=True: 1.8e-7 and 6.0e-8 in the
# outputs, 1.2e-7 and 3.0e-8 in the final state.
def test_matches_transformers_functions():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, h0 = _inputs()
    ours, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for theirs, their_state in (
        torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True),
        torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True),
    ):
        assert (ours - theirs).abs().max() < 1e-6
        assert (state - their_state).abs().max() < 1e-6


def _qwen3_5_layer():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=DIM, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
                               linear_value_head_dim=DV, linear_conv_kernel_dim=K, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()


def _olmo_hybrid_layer():
    from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

    config = OlmoHybridConfig(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4,
                              layer_types=["linear_attention", "full_attention"], linear_num_key_heads=HK,
                              linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                              linear_conv_kernel_dim=K, linear_allow_neg_eigval=True)
    torch.manual_seed(0)
    return OlmoHybridGatedDeltaNet(config, layer_idx=0).eval()


def _randomize(module: torch.nn.Module, seed: int = 1) -> None:
    """Every parameter drawn anew (the gated norm's weights are ones otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _split_conv(ours: GatedDeltaNet, conv_weight: torch.Tensor) -> None:
    """transformers' one conv1d over q|k|v channels -> conv_q, conv_k, conv_v."""
    with torch.no_grad():
        wq, wk, wv = conv_weight.split([HK * DK, HK * DK, HV * DV], dim=0)
        ours.conv_q.weight.copy_(wq), ours.conv_k.weight.copy_(wk), ours.conv_v.weight.copy_(wv)


def _ours_from_qwen3_5(hf) -> GatedDeltaNet:
    ours = GatedDeltaNet(DIM, n_k_heads=HK, n_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel=K, chunk_size=8)
    with torch.no_grad():
        wq, wk, wv = hf.in_proj_qkv.weight.split([HK * DK, HK * DK, HV * DV], dim=0)
        for mine, theirs in ((ours.wq, wq), (ours.wk, wk), (ours.wv, wv), (ours.wz, hf.in_proj_z.weight),
                             (ours.wb, hf.in_proj_b.weight), (ours.wa, hf.in_proj_a.weight),
                             (ours.wo, hf.out_proj.weight)):
            mine.weight.copy_(theirs)
        ours.A_log.copy_(hf.A_log), ours.dt_bias.copy_(hf.dt_bias), ours.norm.weight.copy_(hf.norm.weight)
    _split_conv(ours, hf.conv1d.weight)
    return ours


def _ours_from_olmo_hybrid(hf) -> GatedDeltaNet:
    ours = GatedDeltaNet(DIM, n_k_heads=HK, n_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel=K,
                         norm_eps=1e-5, allow_neg_eigval=True, chunk_size=8)
    with torch.no_grad():
        for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wz", "g_proj"),
                             ("wb", "b_proj"), ("wa", "a_proj"), ("wo", "o_proj")):
            getattr(ours, mine).weight.copy_(getattr(hf, theirs).weight)
        ours.A_log.copy_(hf.A_log), ours.dt_bias.copy_(hf.dt_bias), ours.norm.weight.copy_(hf.o_norm.weight)
    _split_conv(ours, hf.conv1d.weight)
    return ours


# Measured (fp32, T=21, weights ~ N(0, 0.3^2), outputs up to 2.7): 3.3e-7 against
# Qwen3_5GatedDeltaNet and 7.2e-7 against OlmoHybridGatedDeltaNet (allow_neg_eigval, o_norm eps
# 1e-5). Flipping allow_neg_eigval moves the outputs by 0.25 and 1.5.
@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_5", "olmo_hybrid"])
def test_module_matches_transformers_layer(family):
    hf = _qwen3_5_layer() if family == "qwen3_5" else _olmo_hybrid_layer()
    _randomize(hf)
    ours = (_ours_from_qwen3_5 if family == "qwen3_5" else _ours_from_olmo_hybrid)(hf)
    x = torch.randn(2, 21, DIM, generator=torch.Generator().manual_seed(2))
    theirs, mine = hf(x), ours(x, None, AttentionMask(is_causal=True))
    assert theirs.abs().max() > 0.1
    assert (mine - theirs).abs().max() < 1e-5


def _module(seed: int = 0, **kw) -> GatedDeltaNet:
    torch.manual_seed(seed)
    m = GatedDeltaNet(DIM, n_k_heads=HK, n_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel=K,
                      chunk_size=4, **kw)
    _randomize(m)
    return m


@torch.no_grad()
def test_packed_documents_are_kept_apart():
    m = _module()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(1, 7, DIM, generator=gen), torch.randn(1, 10, DIM, generator=gen)
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 7 + [1] * 10])
    out = m(packed, None, AttentionMask(document_ids=docs))
    alone_a, alone_b = m(a, None, AttentionMask()), m(b, None, AttentionMask())
    assert (out[:, :7] - alone_a).abs().max() < 1e-5
    assert (out[:, 7:] - alone_b).abs().max() < 1e-5
    # Without the ids B's tokens see A's, through the state and the convolution alike.
    assert (m(packed, None, AttentionMask())[:, 7:] - alone_b).abs().max() > 1e-3
    # Its first K - 1 tokens would see A's inputs through the convolution alone.
    values, w = m.wv(packed), m.conv_v.weight
    conv_out, _ = causal_conv(values, w, document_ids=docs)
    assert (conv_out[:, 7:] - causal_conv(values[:, 7:], w)[0]).abs().max() < 1e-6
    assert (causal_conv(values, w)[0][:, 7] - conv_out[:, 7]).abs().max() > 1e-3


def test_chunked_documents_equal_recurrent_documents():
    q, k, v, g, beta, _ = _inputs(T=23)
    docs = torch.tensor([[0] * 3 + [1] * 12 + [2] * 8, [4] * 23])  # row 2: one document
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True, document_ids=docs)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, output_final_state=True, document_ids=docs)
    assert (o_c - o_r).abs().max() < 1e-6 and (s_c - s_r).abs().max() < 1e-6
    # The final state is the last document's: the same as running it alone.
    _, s_last = recurrent_gated_delta_rule(*(t[:1, 15:] for t in (q, k, v, g, beta)), output_final_state=True)
    assert (s_c[:1] - s_last).abs().max() < 1e-6


def _fake_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              cu_seqlens):
    """fla's calling convention on CPU: heads already grouped, one flat row split by cu_seqlens,
    one state per document."""
    assert use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5 and q.shape[2] == v.shape[2]
    if cu_seqlens is None:
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                          output_final_state=output_final_state)
    assert q.shape[0] == 1
    outs, states = [], []
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        h0 = None if initial_state is None else initial_state[i:i + 1]
        o, S = recurrent_gated_delta_rule(*(t[:, s:e] for t in (q, k, v, g, beta)), initial_state=h0,
                                          output_final_state=True)
        outs.append(o), states.append(S)
    return torch.cat(outs, dim=1), (torch.cat(states) if output_final_state else None)


def test_the_fla_call_maps_documents_and_states():
    # The arguments forja hands fla's kernel (a CPU stand-in here; tests/gpu runs the kernel).
    q, k, v, g, beta, h0 = _inputs(T=23)
    docs = torch.tensor([[0] * 3 + [1] * 12 + [2] * 8, [4] * 23])
    for ids in (None, docs):
        want = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=h0, output_final_state=True,
                                      document_ids=ids)
        got = fla_gated_delta_rule(_fake_fla, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   document_ids=ids)
        assert (got[0] - want[0]).abs().max() < 1e-6 and (got[1] - want[1]).abs().max() < 1e-6


@torch.no_grad()
def test_cache_prefill_then_decode_equals_full_forward():
    m = _module(allow_neg_eigval=True)
    x = torch.randn(2, 15, DIM, generator=torch.Generator().manual_seed(4))
    full = m(x, None, AttentionMask(is_causal=True))
    cache = KVCache(3, 2, 15, 1, 1, dtype=torch.float32, device="cpu", layers=[])
    parts = [m(x[:, :6], None, AttentionMask(is_causal=True), cache=cache, layer=2)]  # prefill
    parts += [m(x[:, 6:9], None, AttentionMask(), cache=cache, layer=2)]  # a chunk after the cache
    parts += [m(x[:, t:t + 1], None, AttentionMask(), cache=cache, layer=2) for t in range(9, 15)]
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-5
    state = cache.mixer_states[2]
    assert state.recurrent.shape == (2, HV, DK, DV) and state.conv[2].shape == (2, K - 1, HV * DV)


def test_gradients_of_chunked_equal_recurrent():
    inputs = [t.clone().requires_grad_() for t in _inputs(B=1, T=11)]
    grads = []
    for fn in (recurrent_gated_delta_rule, lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=4, **kw)):
        o, s = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        grads.append(torch.autograd.grad((o.square().sum() + s.sum()), inputs))
    for a, b in zip(*grads):
        assert a.abs().max() > 1e-3  # every input gets a gradient
        assert (a - b).abs().max() < 1e-5  # measured: at most 7.2e-7


def test_module_backward_reaches_every_parameter():
    m = _module()
    x = torch.randn(2, 9, DIM, requires_grad=True)
    m(x, None, AttentionMask(document_ids=torch.tensor([[0] * 4 + [1] * 5] * 2))).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name
    assert x.grad.abs().max() > 0


def test_init_rules():
    m = GatedDeltaNet(DIM, n_k_heads=HK, n_v_heads=16, head_k_dim=DK, head_v_dim=DV, conv_kernel=K)

    def rule(name, dt="inv_softplus"):
        return gated_deltanet_init_rule(name, conv_kernel=K, dt_bias=dt) or ("trunc_normal", 0.02)

    init_parameters(m, seed=7, rule=rule)
    A = m.A_log.detach().exp()
    assert A.min() >= 0.01 and A.max() <= 16 and A.std() > 1
    dt = F.softplus(m.dt_bias.detach())
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert 0 < m.conv_q.weight.abs().max() <= K**-0.5
    first = m.A_log.detach().clone()
    init_parameters(m, seed=7, rule=rule)
    assert torch.equal(m.A_log.detach(), first)  # the same seed, the same values
    init_parameters(m, seed=7, rule=lambda n: rule(n, dt="ones"))
    assert torch.equal(m.dt_bias.detach(), torch.ones(16))
    assert gated_deltanet_init_rule("layers.0.attention.wq.weight") is None
    assert gated_deltanet_init_rule("layers.3.attention.A_log") == ("uniform_log", 0.01, 16.0)
    assert math.isclose(gated_deltanet_init_rule("x.conv_v.weight", conv_kernel=4)[2], 0.5)


def test_heads_that_do_not_group_are_refused():
    with pytest.raises(ValueError, match="multiple of n_k_heads"):
        GatedDeltaNet(DIM, n_k_heads=3, n_v_heads=4, head_k_dim=DK, head_v_dim=DV)


# -- every family with Gated DeltaNet blocks -----------------------------------------------------

def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 2048, (2, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize(("family", "overrides"), [("qwen3_5", {}), ("qwen3_next", {}),
                                                   ("olmo_hybrid", dict(rope_theta=None)),
                                                   ("olmo_hybrid", dict(rope_theta=10_000.0))])
def test_packed_documents_equal_each_document_alone(family, overrides):
    model = build_model(family, "debug", seed=1, **overrides).eval()
    a, b = _tokens(30, seed=5)[:1], _tokens(21, seed=6)[:1]
    packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 30 + [1] * 21]))
    torch.testing.assert_close(packed[:, 30:], model(b), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, :30], model(a), atol=2e-5, rtol=1e-5)
    assert (model(torch.cat([a, b], 1))[:, 30:] - model(b)).abs().max() > 1e-3  # the ids matter


@pytest.mark.parametrize(("family", "flavor", "overrides"), [
    ("qwen3_5", "debug-moe", {}),
    ("qwen3_next", "debug", dict(mtp_depth=1)),  # the MTP module's loss joins the backward
    ("olmo_hybrid", "debug", dict(rope_theta=10_000.0)),
])
def test_a_training_step_reaches_every_parameter(family, flavor, overrides):
    model = build_model(family, flavor, seed=2, **overrides)
    tokens = _tokens(24)
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
