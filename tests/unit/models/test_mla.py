"""Multi-head latent attention and YaRN against transformers' DeepSeek-V3 code, on random weights."""

from __future__ import annotations

import math

import pytest
import torch

from forja.models.common.attention import AttentionMask, KVCache, build_mask
from forja.models.common.mla import MLA
from forja.models.common.rope import RopeScaling, YarnScaling, apply_rope, rope_cos_sin, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

# Bound on max |difference| of MLA's output against DeepseekV3Attention, float32. Measured 0.0
# in every case (transformers 5.24, torch 2.13, CPU): the same ops in the same order, SDPA on
# both sides; the bound leaves room for kernels that block matmuls differently.
MLA_TOL = 1e-6

YARN_CASES = {
    # The released V3 values, a 40x extension of 4K (mscale = mscale_all_dim: cos/sin unscaled).
    "v3": dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
               mscale_all_dim=1.0),
    # Unequal mscales (cos/sin scaled), other betas, a short original context.
    "mscales": dict(factor=4.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2, mscale=0.9,
                    mscale_all_dim=0.7),
    # No mscale at all: cos/sin scaled by 0.1 ln(factor) + 1, softmax unscaled; no rounding of the ramp.
    "plain": dict(factor=8.0, original_max_position_embeddings=32, truncate=False),
}


def _yarn(p: dict) -> YarnScaling:
    return YarnScaling(factor=p["factor"], original_max_seq_len=p["original_max_position_embeddings"],
                       beta_fast=p.get("beta_fast", 32.0), beta_slow=p.get("beta_slow", 1.0),
                       mscale=p.get("mscale", 0.0), mscale_all_dim=p.get("mscale_all_dim", 0.0),
                       truncate=p.get("truncate", True))


def _hf_config(q_lora_rank: int | None, yarn: dict | None, **kw):
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if yarn is not None:
        rope = {"rope_type": "yarn", "rope_theta": 10_000.0, **yarn}
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
               kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-5,
               max_position_embeddings=int(yarn["factor"] * yarn["original_max_position_embeddings"]) if yarn else 256,
               rope_parameters=rope, initializer_range=0.1)
    config = transformers.DeepseekV3Config(**{**cfg, **kw})
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("name", list(YARN_CASES))
@pytest.mark.parametrize("head_dim", [8, 64])
def test_yarn_frequencies_and_scales_equal_transformers(name, head_dim):
    p = YARN_CASES[name]
    config = _hf_config(None, p, qk_rope_head_dim=head_dim)
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    s = _yarn(p)
    assert torch.equal(rope_frequencies(head_dim, 10_000.0, s), inv_freq)
    assert s.rope_scale() == attention_factor
    # The softmax scale of DeepseekV3Attention, bit for bit.
    hf_scaling = hf_ds.DeepseekV3Attention(config, 0).scaling
    assert s.softmax_scale(config.qk_head_dim**-0.5) == hf_scaling
    if not p.get("mscale_all_dim"):
        assert hf_scaling == config.qk_head_dim**-0.5


def test_yarn_keeps_high_frequencies_and_divides_low_ones():
    s = YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0)
    plain, scaled = rope_frequencies(64, 10_000.0), rope_frequencies(64, 10_000.0, s)
    assert torch.equal(scaled[:8], plain[:8])  # many turns over 4K positions: untouched
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 40)  # under one turn: interpolated
    assert s.rope_scale() == 1.0 and s.softmax_scale(1.0) == pytest.approx((0.1 * math.log(40) + 1) ** 2)


def test_llama_scaling_and_plain_tables_unchanged():
    # The YaRN additions leave Llama's paths as they were: no scale, same tables.
    inv = rope_frequencies(16, 500_000.0, RopeScaling(original_max_seq_len=32))
    cos, sin = rope_cos_sin(inv, torch.arange(5))
    cos1, sin1 = rope_cos_sin(inv, torch.arange(5), 1.0)
    assert torch.equal(cos, cos1) and torch.equal(sin, sin1)
    angles = torch.arange(5).float()[:, None] * inv[None]
    assert torch.equal(cos, torch.cat([angles, angles], -1).cos())


def test_interleaved_pairs_permuted_to_halves_rotate_bit_for_bit():
    # DeepSeek rotates pairs (x0, x1), (x2, x3), ...; forja (x_i, x_{i+d/2}). With the rope
    # dimensions reordered evens-then-odds, forja's rotation gives transformers' output exactly.
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 1, 5, 8, generator=gen)  # (B, H, T, dr)
    cos, sin = rope_cos_sin(rope_frequencies(8, 10_000.0), torch.arange(5))
    ref_q, ref_k = hf_ds.apply_rotary_pos_emb_interleave(q, k, cos[None], sin[None])
    halves = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    ours = [apply_rope(t[..., halves].transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k)]
    assert torch.equal(ours[0], ref_q) and torch.equal(ours[1], ref_k)


def _deinterleave_rows(w: torch.Tensor, block: int, before: int) -> torch.Tensor:
    """The rope rows of every `block` rows of w, from DeepSeek's interleaved order to halves."""
    rope = block - before
    order = torch.cat([torch.arange(before), before + torch.arange(0, rope, 2), before + torch.arange(1, rope, 2)])
    return w.view(-1, block, w.shape[-1])[:, order].reshape(w.shape)


def mla_from_hf(hf, config) -> MLA:
    """A forja MLA holding the weights of a transformers DeepseekV3Attention."""
    c = config
    scaling = _yarn(c.rope_parameters) if c.rope_parameters["rope_type"] == "yarn" else None
    scale = c.qk_head_dim**-0.5 if scaling is None else scaling.softmax_scale(c.qk_head_dim**-0.5)
    mla = MLA(c.hidden_size, c.num_attention_heads, q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank,
              qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
              softmax_scale=scale)
    q_rows = dict(block=c.qk_head_dim, before=c.qk_nope_head_dim)
    with torch.no_grad():
        if c.q_lora_rank:
            mla.wq_a.weight.copy_(hf.q_a_proj.weight)
            mla.q_norm.weight.copy_(hf.q_a_layernorm.weight)
            mla.wq_b.weight.copy_(_deinterleave_rows(hf.q_b_proj.weight, **q_rows))
        else:
            mla.wq.weight.copy_(_deinterleave_rows(hf.q_proj.weight, **q_rows))
        mla.wkv_a.weight.copy_(_deinterleave_rows(hf.kv_a_proj_with_mqa.weight, c.kv_lora_rank + c.qk_rope_head_dim,
                                                  c.kv_lora_rank))
        mla.kv_norm.weight.copy_(hf.kv_a_layernorm.weight)
        mla.wkv_b.weight.copy_(hf.kv_b_proj.weight)
        mla.wo.weight.copy_(hf.o_proj.weight)
    return mla


def _hf_attention(config, seed: int = 0):
    torch.manual_seed(seed)
    hf = hf_ds.DeepseekV3Attention(config, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random norms too, not ones
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1 if p.dim() > 1 else 0.3)
    return hf


def _tables(config, T: int):
    """transformers' cos/sin (1, T, dr), and forja's (T, dr)."""
    rotary = hf_ds.DeepseekV3RotaryEmbedding(config)
    x = torch.zeros(1, T, config.hidden_size)
    hf_cos, hf_sin = rotary(x, torch.arange(T)[None])
    inv = rotary.inv_freq  # also checked against forja's in the YaRN test
    return (hf_cos, hf_sin), rope_cos_sin(inv, torch.arange(T), rotary.attention_scaling)


@torch.no_grad()
@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("yarn", [None, "mscales", "v3"])
def test_mla_equals_transformers_attention(q_lora_rank, yarn):
    config = _hf_config(q_lora_rank, YARN_CASES.get(yarn))
    hf = _hf_attention(config)
    mla = mla_from_hf(hf, config)
    T = 40
    x = torch.randn(2, T, config.hidden_size, generator=torch.Generator().manual_seed(1))
    hf_tables, ours_tables = _tables(config, T)
    torch.testing.assert_close(ours_tables[0], hf_tables[0][0], rtol=0, atol=0)
    ref, _ = hf(x, hf_tables, attention_mask=None)
    out = mla(x, ours_tables, AttentionMask(is_causal=True))
    diff = (out - ref).abs().max().item()
    print(f"q_lora_rank={q_lora_rank} yarn={yarn}: max |MLA - DeepseekV3Attention| = {diff:.2e}")
    assert diff < MLA_TOL


def _forja_mla(seed: int = 0, q_lora_rank: int = 24) -> MLA:
    torch.manual_seed(seed)
    mla = MLA(64, 4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, softmax_scale=24**-0.5)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    return mla


@torch.no_grad()
def test_kv_cache_with_narrow_values_matches_full_forward():
    mla = _forja_mla()
    T = 12
    x = torch.randn(2, T, 64)
    tables = rope_cos_sin(rope_frequencies(8, 10_000.0), torch.arange(T))
    full = mla(x, tables, AttentionMask(is_causal=True))
    cache = KVCache(1, 2, T, 4, 24, value_dim=12, dtype=torch.float32, device="cpu")
    assert cache.values[0].shape == (2, 4, T, 12) and cache.keys[0].shape == (2, 4, T, 24)
    parts = []
    for start, end in [(0, 5), (5, 7), *[(t, t + 1) for t in range(7, T)]]:
        sub = tuple(t[start:end] for t in tables)
        parts.append(mla(x[:, start:end], sub, build_mask(None, q_len=end - start, kv_len=end), cache, 0))
        cache.advance(end - start)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_packed_documents_do_not_see_each_other():
    mla = _forja_mla(q_lora_rank=0)
    a, b = torch.randn(1, 5, 64), torch.randn(1, 9, 64)
    tables = rope_cos_sin(rope_frequencies(8, 10_000.0), torch.arange(14))
    docs = torch.tensor([[0] * 5 + [1] * 9])
    packed = mla(torch.cat([a, b], 1), tables, build_mask(docs, q_len=14, kv_len=14))
    alone = mla(a, tuple(t[:5] for t in tables), AttentionMask(is_causal=True))
    torch.testing.assert_close(packed[:, :5], alone, rtol=1e-5, atol=1e-5)
    # Rotary positions are relative: b alone (positions from 0) sees what it sees packed.
    torch.testing.assert_close(packed[:, 5:], mla(b, tuple(t[:9] for t in tables), AttentionMask(is_causal=True)),
                               rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_weight():
    mla = _forja_mla()
    x = torch.randn(2, 6, 64, requires_grad=True)
    tables = rope_cos_sin(rope_frequencies(8, 10_000.0), torch.arange(6))
    mla(x, tables, AttentionMask(is_causal=True)).square().sum().backward()
    for name, p in mla.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0
