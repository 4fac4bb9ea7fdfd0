"""Gemma 4 (text) against transformers 5.25's Gemma4ForCausalLM: the conformance CASE
(per-layer embeddings, shared key/value layers with double-wide MLPs, global blocks with
their own head width and key/value heads, values = keys, proportional RoPE, value norms,
unscaled scores, stored layer scalars, soft-capped logits, the mixture of experts beside the
dense MLPs; sequences longer than the window; the published sizes; refusals) and what is
Gemma 4's own: the released config dialect, the KV cache holding only the producers' keys,
FLOPs, the router, pipeline stages (split and chained in one process; trained over 2 ranks in
tests/distributed/test_parity_families.py). Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import json

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args
from forja.models.gemma4.moe import Gemma4MoE
from tests.unit.models import family_checks as checks
from tests.unit.models import float64_casts
from tests.unit.models.test_flops import measured_flops_per_token

transformers = pytest.importorskip("transformers")

_KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
          "full_attention"]
# The `debug` flavor (transformers' default rope parameters: proportional RoPE over a quarter
# of the global blocks' frequencies, base 1e6; local base 1e4).
_DEBUG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
              head_dim=32, global_head_dim=64, num_global_key_value_heads=2, attention_k_eq_v=True, vocab_size=2048,
              vocab_size_per_layer_input=2048, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
              use_double_wide_mlp=True, max_position_embeddings=2048, rms_norm_eps=1e-6, sliding_window=8,
              final_logit_softcapping=30.0, layer_types=_KINDS, pad_token_id=0, eos_token_id=1, bos_token_id=2)
# The mixture of experts in every block (`enable_moe_block`, the 26B-A4B's kind): the `debug-moe` flavor.
_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64)
# No per-layer embeddings or sharing (the 31B's kind), values of their own, a global head
# width of its own over all its frequencies scaled by 2 (proportional RoPE's factor), the
# last block made global by transformers, untied, not capped, a window of 5.
_PLAIN = dict(_DEBUG, num_hidden_layers=4, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
              attention_k_eq_v=False, use_double_wide_mlp=False, num_key_value_heads=2, head_dim=16, global_head_dim=48,
              tie_word_embeddings=False, final_logit_softcapping=None, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                                                  "factor": 2.0, "rope_theta": 50_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


def _scale(key: str) -> bool:
    """A scale transformers starts at one: every norm's, the router's own and its per-expert ones."""
    return "norm" in key or key.endswith(("router.scale", "per_expert_scale"))


def _make(name: str, config: checks.HFConfig, seed: int):
    """transformers' model on random weights, its scales (norms', the router's) drawn around one
    and each block's stored layer_scalar (a buffer transformers starts at one) drawn too."""
    model = checks.random_hf_model(config.cls, config.config, seed, pick=lambda key, p: _scale(key),
                                   draw=lambda p: p.normal_(1.0, 0.3))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
    return model


@torch.no_grad()
def _scales(model) -> None:
    """forja starts norm scales, the router's per-expert scales and layer scalars at one; make each tell."""
    gen = torch.Generator().manual_seed(3)
    for key, t in model.state_dict().items():
        if _scale(key) or "layer_scalar" in key:
            t.copy_(0.5 + torch.rand(t.shape, generator=gen))


CASE = checks.FamilyCase(
    family="gemma4",
    # The first is what test_random_configs.py draws around: one shared block, so that a draw of
    # two blocks still has a producer (transformers cannot run a model whose every block shares),
    # and the experts' keys with enable_moe_block off, which each draw turns on or leaves off.
    configs={"shared-1": checks.HFConfig("Gemma4ForCausalLM", {**_DEBUG, **_MOE, "num_kv_shared_layers": 1,
                                                                 "enable_moe_block": False}),
             "debug": checks.HFConfig("Gemma4ForCausalLM", _DEBUG, "debug"),
             "debug-moe": checks.HFConfig("Gemma4ForCausalLM", dict(_DEBUG, **_MOE), "debug-moe"),
             "plain": checks.HFConfig("Gemma4ForCausalLM", _PLAIN)},
    make=_make,
    # Bound on max |logit difference| in float32, against transformers 5.25, torch 2.13, CPU:
    # 0.0 on every config here on an Intel CPU with AMX; on an AMD EPYC (AVX-512, no AMX)
    # debug-moe reads 1.37e-5, the experts rounding apart as below. A random draw with experts may
    # differ in the last place (transformers takes the GELU of its fused gate_up output's strided
    # gate half, forja of a contiguous gate, and torch's CPU kernel rounds the two paths apart by
    # 2.4e-7 on an activation), which its peaked logits near the cap of 30 carry to 3.0e-5 at most
    # over 24 draws: test_random_configs.py then holds it to float64 exactness and transformers'
    # own float32 error instead (transformers' grouped_mm and eager experts differ by 1.3e-5 there).
    tol=3e-5,
    # float64: transformers' Gemma4RMSNorm computes on x.float() and multiplies by the weight in
    # float32 (eight norms a block, value and per-layer norms included), its router's softmax in
    # float32; forja's at least in float32: all in float64 (tests/unit/models/float64_casts.py).
    # The embedding scales are float32 buffers (sqrt of the widths to float32's digits) where
    # forja multiplies by the float64 numbers: the float64 copy's are set to the numbers.
    float64_kept=("gemma4.Gemma4RMSNorm.forward", "gemma4.Gemma4TextRouter.forward"),
    float64_fix=float64_casts.exact_embed_scales,
    tokens=40,  # five windows of 8
    layout=checks.stored_names,
    # 9 + 12 = 21 positions, more than two windows of 8 (four of 5): each step decodes past a window.
    greedy={"debug": 12, "debug-moe": 12, "plain": 12},
    export_flavors=("debug", "debug-moe"),
    prepare_export=_scales,
    # Text models, tied embedding once; equal to transformers' count for the same config.json
    # (built on the meta device). The E2B's per-layer embedding table is 35 x 256 x 262,144 =
    # 2.35B of it, the E4B's 42 x 256 x 262,144 = 2.82B; the 26B-A4B's (total, active) are the
    # model card's 25.2B / 3.8B, the 31B's its 30.7B (forja/models/gemma4/__init__.py).
    published={"e2b": (4_628_569_344,), "e4b": (7_463_013_376,), "26b-a4b": (25_233_141_760, 3_822_530_560),
               "31b": (30_697_345_280,), "debug": (1_663_280,), "debug-moe": (2_852_192, 1_967_456)},
    refusals=(
        ("debug", dict(enable_moe_block=True), r"num_experts=None is not supported"),
        ("debug", dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported"),
        ("debug", dict(use_bidirectional_attention="all"), r"use_bidirectional_attention='all' is not supported"),
        ("debug", dict(attention_bias=True), r"attention_bias=True is not supported"),
        ("debug", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
         r"rope_parameters\.full_attention\.rope_type='yarn' is not supported"),
        ("debug", dict(rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 1e4}}),
         r"rope_parameters\.sliding_attention\.rope_type='linear' is not supported"),
        ("debug", dict(per_layer_config={"0": {"head_dim": 16}}), r"per_layer_config\.0=.* is not supported"),
    ),
    export_refusals=(
        (dict(query_pre_attn_scalar=4), "a Gemma 4 with query_pre_attn_scalar="),
        (dict(layer_types=tuple(_KINDS[:-1]) + ("sliding_attention",), kv_shared_layers=0),
         "a Gemma 4 with layer_types="),
        (dict(n_experts=8, top_k=2, moe_ffn_dim=64, norm_topk_prob=False), "a Gemma 4 with norm_topk_prob="),
        (dict(n_experts=8, top_k=2, moe_ffn_dim=64, expert_activation="swiglu"),
         "a Gemma 4 with expert_activation="),
    ),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def test_options_reach_the_model(loaded):
    a = loaded["plain"].args
    assert (a.rope_theta, a.local_rope_theta, a.rope_linear_factor, a.global_rotary_fraction) == (50_000.0, 100.0,
                                                                                                 2.0, 1.0)
    assert (a.global_head_dim, a.global_kv_heads, a.ple_dim, a.kv_shared_layers) == (48, 2, 0, 0)
    assert a.layer_types[-1] == "full_attention" and not a.tie_embeddings and a.final_logit_softcap is None
    d = loaded["debug"]
    assert d.layers["4"].attention.wk is None and d.layers["5"].attention.wv is None  # shared blocks
    assert d.layers["2"].attention.wv is None and d.layers["0"].attention.wv is not None  # values = keys, globally
    assert d.layers["5"].feed_forward.w1.out_features == 2 * 256  # double-wide
    assert [d.args.producer(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert d.args.n_experts == 0 and d.layers["0"].mlp is None and loaded["shared-1"].args.n_experts == 0
    m = loaded["debug-moe"]  # every block: experts (its feed_forward) beside its dense MLP (`mlp`)
    assert (m.args.n_experts, m.args.top_k, m.args.moe_ffn_dim, m.args.expert_activation) == (8, 2, 64, "geglu")
    assert all(isinstance(block.feed_forward, Gemma4MoE) for block in m.layers.values())
    assert m.layers["5"].feed_forward.experts.w1.shape == (8, 64, 128) and m.layers["5"].mlp.w1.out_features == 512


@pytest.mark.parametrize("name", ["debug", "debug-moe"])
def test_the_flavors_configs_match_transformers_within_the_familys_bound(checkpoints, loaded, name):
    """The flavors, dense and with experts, closer than the family's bound (CASE.tol's note)."""
    model = loaded[name]
    assert checks.check_logits(checkpoints[name][1], model, checks.random_tokens(40, 5, vocab_size=2048), CASE.tol,
                               family="gemma4", flavor=name, label=name) < CASE.tol


def test_the_released_config_dialect_reads_the_same(checkpoints, loaded, tmp_path):
    """google's config.json: global_head_dim and num_global_key_value_heads, no per_layer_config."""
    src = checkpoints["debug"][0]
    assert "per_layer_config" in json.loads((src / "config.json").read_text())
    dst = checks.edited_checkpoint(src, tmp_path / "ckpt", drop=("per_layer_config",), global_head_dim=64,
                                   num_global_key_value_heads=2)
    assert load_hf_checkpoint(dst).args == loaded["debug"].args


def test_the_cache_holds_only_the_producers_keys(loaded):
    model = loaded["debug"]
    cache = model.new_kv_cache(2, 16)
    assert cache.keys[4] is None and cache.keys[5] is None  # shared blocks read their producers'
    assert cache.keys[0].shape == (2, 4, 16, 32) and cache.keys[2].shape == (2, 2, 16, 64)


def test_uncached_decoding_equals_cached(loaded):
    from forja.generate import SamplingConfig, generate

    model, prompt = loaded["debug"], checks.random_tokens(9, vocab_size=2048)
    config = SamplingConfig(max_new_tokens=10)
    assert torch.equal(generate(model, prompt, config), generate(model, prompt, config, use_cache=False))


# -- sizes and FLOPs ---------------------------------------------------------------------------

def test_debug_flavor_is_the_advertised_size():
    model = build_model("gemma4", "debug", seed=0)
    assert 1.5e6 < model.num_params() < 1.8e6
    assert torch.equal(model.state_dict()["layers.2.layer_scalar"], torch.ones(1))
    assert torch.equal(model.state_dict()["layers.2.post_ffn_norm.weight"], torch.ones(128))  # the scale itself
    # The query scale starts at hd^-1/2 (the block's head width: 64 global, 32 local): scores q.k / sqrt(hd).
    assert torch.equal(model.state_dict()["layers.2.attention.q_norm.weight"], torch.full((64,), 64**-0.5))
    assert torch.equal(model.state_dict()["layers.4.attention.q_norm.weight"], torch.full((32,), 32**-0.5))


def test_flops_formula_within_5_percent_of_counted():
    model = build_model("gemma4", "debug")
    T = model.args.sliding_window  # every block sees all T keys: the dense mask's count is the kernel's
    ratio = model.flops_per_token(T) / measured_flops_per_token(model, 2, T)
    print(f"gemma4 debug T={T}: formula/measured = {ratio:.4f}")
    assert abs(ratio - 1) < 0.05
    a = model.args  # past the window only the global blocks count new keys
    assert model.flops_per_token(64) - model.flops_per_token(32) == 2 * 12 * a.n_heads * a.global_head_dim * 32


# -- bad input -------------------------------------------------------------------------------

def test_sharing_needs_a_producer_of_each_kind():
    with pytest.raises(ForjaError, match="kv_shared_layers=4 leaves full_attention blocks"):
        model_args("gemma4", "debug", kv_shared_layers=4, layer_types=("sliding_attention",) * 2
                   + ("full_attention",) * 4)
    with pytest.raises(ForjaError, match="kv_shared_layers=6 must be between 0 and n_layers - 1"):
        model_args("gemma4", "debug", kv_shared_layers=6)


# -- the router ----------------------------------------------------------------------------

def test_the_router_scores_the_raw_stream_and_scales_each_expert_after_renormalizing():
    """softmax(gate(rms(x) * scale / sqrt(D))), its top k renormalized to sum to one, each then
    times its expert's per_expert_scale; the experts read a norm of x of their own."""
    torch.manual_seed(0)
    router = build_model("gemma4", "debug-moe", seed=1).layers["0"].feed_forward.router
    with torch.no_grad():
        router.norm.weight.uniform_(0.5, 1.5)
        router.per_expert_scale.copy_(torch.arange(1.0, 9.0))
    x = 3.0 * torch.randn(5, 128)
    route = router(x)
    logits = router.gate(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * router.norm.weight / 128**0.5)
    top = logits.softmax(-1).topk(2)
    want = top.values / top.values.sum(-1, keepdim=True) * (top.indices + 1.0)  # per_expert_scale e = e + 1
    assert torch.equal(route.experts.sort(-1).values, top.indices.sort(-1).values)
    torch.testing.assert_close(route.weights.gather(1, route.experts.argsort(-1)),
                               want.gather(1, top.indices.argsort(-1)), rtol=1e-6, atol=0)
    assert not torch.allclose(route.weights.sum(-1), torch.ones(5))  # the per-expert scales come after


# -- pipeline stages ---------------------------------------------------------------------------

def test_a_pipeline_keeps_the_shared_blocks_with_the_blocks_they_read():
    from forja.parallel.checks import LayoutRequest, layout_errors
    from forja.parallel.config import ParallelConfig
    from forja.parallel.pp_split import layers_per_stage

    args = model_args("gemma4", "debug-moe")
    assert [span[:2] for span in args.pipeline_spans()] == [(2, 5)]  # blocks 4 and 5 read 3 and 2
    assert model_args("gemma4", "debug", kv_shared_layers=0).pipeline_spans() == []
    meta = build_model("gemma4", "debug-moe", device="meta")
    split = lambda pp, layers=(): layers_per_stage(meta, pp=pp, schedule="1f1b", pp_layers=list(layers),  # noqa: E731
                                                   seq_len=32)
    assert split(2) == [2, 4] and split(3) == [1, 1, 4]  # balanced, [3, 3] and [2, 2, 2], would cut the span
    with pytest.raises(ForjaError, match=r"ends a stage after block 2, but blocks 2 to 5 must share a stage"):
        split(2, [3, 3])
    with pytest.raises(ForjaError, match=r"n_layers = 6 \(Gemma 4's shared key/value blocks 4-5 .* lower parallel.pp"):
        split(4)
    request = LayoutRequest(args=args, parallel=ParallelConfig(pp=2, dp_shard=1), world_size=2, seq_len=32,
                            global_batch_size=4, micro_batch_size=2)
    assert layout_errors(request) == []


@pytest.mark.parametrize("counts", [[2, 4], [1, 1, 4], [0, 2, 4]])
def test_stages_chained_compute_what_the_whole_model_does(counts):
    """Each stage hands on the hidden states and the later blocks' per-layer inputs in one
    tensor: the chain's loss and every gradient are the whole model's, the per-layer tables' too."""
    from forja.parallel.pp_split import stage_part

    model = build_model("gemma4", "debug-moe", seed=3, tie_embeddings=False)
    tokens, labels = (checks.random_tokens(20, seed, vocab_size=2048) for seed in (1, 2))
    docs = torch.tensor([[0] * 12 + [1] * 8, [0] * 20])
    parts = [stage_part(model, s, counts) for s in range(len(counts))]
    h = tokens
    for part in parts[:-1]:
        h = part(h, docs)
        assert h.shape == (2, 20, part.stage_widths()[1]) and h.shape[-1] == 128 + 16 * (6 - sum(
            counts[:parts.index(part) + 1]))
    loss = parts[-1](h, docs, labels=labels)
    loss.backward()
    whole = model(tokens, docs, labels=labels)
    whole.backward()
    assert torch.equal(loss, whole)
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(grads[name], p.grad), name
