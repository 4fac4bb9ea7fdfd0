"""gpt-oss against transformers: the conformance CASE (sliding windows, sinks, YaRN, the
router's bias and top-k softmax, the experts' biases and clamped SwiGLU; published sizes;
refusals) and what is gpt-oss's own: the window and sinks mattering, packed documents, its
checkpoint layout, the expert and router math piece by piece, a training step through a
packed batch. Tensor parallelism (the sinks sharded with the heads): test_tp_families.py."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=2048,
              num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
              rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150_000.0})
_VARIANT_TYPES = ["full_attention", "sliding_attention", "sliding_attention"]


def _layer_types_are_written(name, model, reloaded, checkpoints) -> None:
    assert reloaded.config.layer_types == [model.args.layer_type(i) for i in range(model.args.n_layers)]


@torch.no_grad()
def _biases_and_sinks(model) -> None:
    """forja starts biases and sinks at 0: give each a value."""
    for key, p in model.named_parameters():
        if p.dim() == 1 or ".b" in key[-3:] or key.endswith("sinks"):
            p.normal_(0.0, 0.1)


CASE = checks.FamilyCase(
    family="gpt_oss",
    configs={
        # The `debug` flavor: sliding (8), full, sliding, full; YaRN without truncation.
        "base": checks.HFConfig("GptOssForCausalLM", _SHAPE, "debug"),
        # A clamp the gate and up projections cross often (0.5, alpha 1.3), YaRN in the 4.x
        # dialect with transformers' default truncation, no attention biases, tied embeddings,
        # 3 blocks with their own layer types and a 5-token window, GQA 4:1, 4 experts top 1.
        "variant": checks.HFConfig("GptOssForCausalLM", dict(
            _SHAPE, num_hidden_layers=3, num_attention_heads=8, head_dim=16, sliding_window=5,
            layer_types=_VARIANT_TYPES, num_local_experts=4, num_experts_per_tok=1, swiglu_limit=0.5,
            swiglu_alpha=1.3, attention_bias=False, tie_word_embeddings=True, rms_norm_eps=1e-6,
            rope_parameters=None, rope_theta=10_000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": 16})),
    },
    # transformers starts every bias but the router's at 0: give each a value
    pick=lambda key, p: key.endswith(("bias", "_bias")), draw=lambda p: p.normal_(0.0, 0.1),
    # Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
    # Measured: 0 to 1.7e-6 for "base" and "variant", plain and packed rows (0 everywhere on a
    # quiet machine; under load BLAS splits its work otherwise). transformers runs an expert's
    # gate and up projections as one interleaved (D, 2H) matmul, forja as two (H, D) ones.
    tol=1e-5,
    # float64: forja's attention with sinks scores at least in float32 (common/attention.py),
    # transformers' in the model's dtype, its router too; transformers' RMSNorm in float64 as
    # forja's (tests/unit/models/float64_casts.py). Measured 0 (4.8e-6 with forja's sinks'
    # softmax in float32).
    float64_kept=("gpt_oss.GptOssRMSNorm.forward",),
    tokens=40,  # 5x the window
    layout=checks.stored_shapes, after_round_trip=_layer_types_are_written,
    # The 9-token prompt already fills the 8- and 5-token windows: each of the 8 steps decodes
    # past them, through transformers' sliding cache, to 17 positions (two windows of 8).
    greedy={"base": 8, "variant": 8},
    prepare_export=_biases_and_sinks,
    # (total, active per token, active without the input embedding): the totals equal
    # transformers' count for the same config.json (built on the meta device); OpenAI's
    # model card counts the active ones without the embedding (its lookup does no matmul) but
    # with the unembedding: 20.91B total / 3.61B active, 116.83B / 5.13B.
    published={"20b": (20_914_757_184, 4_187_440_704, 3_608_307_264),
               "120b": (116_829_156_672, 5_711_982_912, 5_132_849_472)},
    refusals=(
        ("base", dict(quantization_config={"quant_method": "mxfp4"}),
         r"quantization_config\.quant_method='mxfp4' is not supported .*forja loads the bf16/fp32 layout"),
        ("base", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         r"rope_parameters\.rope_type='dynamic' is not supported"),
    ),
    export_refusals=tuple((overrides, f"a gpt-oss with {field}=") for overrides, field in [
        (dict(qk_norm=True), "qk_norm"), (dict(score_func="softmax"), "score_func"),
        (dict(router_bias=False), "router_bias"), (dict(expert_proj_bias=False), "expert_proj_bias"),
        (dict(expert_activation="swiglu"), "expert_activation"), (dict(n_shared_experts=1), "n_shared_experts"),
        (dict(attention_sinks=False), "attention_sinks"), (dict(capacity_factor=1.25), "capacity_factor")]),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


def test_the_variants_options_reach_the_args(loaded):
    a = loaded["variant"].args
    assert a.rope_scaling.truncate and a.swiglu_limit == 0.5
    assert [a.layer_type(i) for i in range(3)] == _VARIANT_TYPES


@torch.no_grad()
def test_the_window_and_the_sinks_change_the_logits(checkpoints, loaded):
    """The comparison above could not pass with either feature missing."""
    hf, model, tokens = checkpoints["base"][1], loaded["base"], _tokens(40)
    ref = hf(tokens).logits
    full = build_model("gpt_oss", "debug", layer_types=["full_attention"] * 4)
    full.load_state_dict(model.state_dict())
    assert (full(tokens) - ref).abs().max() > 1e-2
    sinkless = build_model("gpt_oss", "debug")
    sinkless.load_state_dict(model.state_dict())
    for block in sinkless.layers.values():
        block.attention.sinks.fill_(float("-inf"))
    assert (sinkless(tokens) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(CASE.configs))
@torch.no_grad()
def test_packed_documents_match_transformers(checkpoints, loaded, name):
    hf, model = checkpoints[name][1], loaded[name]
    docs = torch.tensor([[0] * 17 + [1] * 9 + [2] * 14, [0] * 40])
    tokens = _tokens(40, seed=5)
    window = model.args.sliding_window
    masks = checks.hf_document_masks(docs, "sliding_attention", lambda q, k: q - k < window)
    ref = hf(tokens, attention_mask=masks).logits
    diff = (ref - model(tokens, document_ids=docs)).abs().max().item()
    print(f"{name} packed: max |logit diff| = {diff:.3e}")
    assert diff < CASE.tol
    assert (ref - model(tokens)).abs().max() > 1e-2  # the documents do matter


def test_transformers_saves_its_module_layout(checkpoints):
    shapes = checks.stored_shapes(checkpoints["base"][0])
    E, D, H = 8, 128, 96
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == [E, D, 2 * H]  # x @ W, gate/up interleaved
    assert shapes["model.layers.1.mlp.experts.gate_up_proj_bias"] == [E, 2 * H]
    assert shapes["model.layers.1.mlp.experts.down_proj"] == [E, H, D]
    assert shapes["model.layers.1.mlp.experts.down_proj_bias"] == [E, D]
    assert shapes["model.layers.3.mlp.router.bias"] == [E] and shapes["model.layers.0.self_attn.sinks"] == [4]
    assert shapes["model.layers.2.self_attn.o_proj.bias"] == [D]


# -- the expert and router math, piece by piece --------------------------------------------

def test_clamped_swiglu_equals_transformers():
    from forja.models.common.moe import gated_activation

    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_local_experts=2)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg)
    gate_up = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * 6  # well past the clamp at 7
    ours = gated_activation(gate_up[:, 0::2], gate_up[:, 1::2], "clamped_swiglu", cfg.swiglu_limit, cfg.swiglu_alpha)
    assert (gate_up.abs() > 7).any()
    assert torch.equal(ours, experts._apply_gate(gate_up))


def test_top_k_softmax_routing_equals_transformers():
    from forja.models.common.moe import Router

    cfg = transformers.GptOssConfig(hidden_size=16, num_hidden_layers=1, num_local_experts=8, num_experts_per_tok=3)
    torch.manual_seed(0)
    ref_router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(cfg)
    with torch.no_grad():
        ref_router.weight.normal_(), ref_router.bias.normal_()
    router = Router(16, model_args("gpt_oss", "debug", dim=16, n_experts=8, top_k=3))
    router.gate.load_state_dict(ref_router.state_dict())
    x = torch.randn(11, 16)
    _, scores, indices = ref_router(x)
    route = router(x)
    assert torch.equal(route.experts, indices)
    torch.testing.assert_close(route.weights, scores, atol=0, rtol=0)


# -- training ----------------------------------------------------------------------------

def test_a_packed_training_step_equals_its_documents_alone():
    """Sinks, sliding windows and document masks through forja's SDPA-path attention (the
    scores written out): the packed row's gradients are the documents' own, and every
    parameter, sinks and biases included, gets one."""
    model = build_model("gpt_oss", "debug", seed=0).train()
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.sinks.normal_(0.0, 1.0)
    tokens, labels = _tokens(30, seed=6)[:1], _tokens(30, seed=7)[:1]
    cut = 17
    docs = torch.tensor([[0] * cut + [1] * (30 - cut)])
    model(tokens, docs, labels=labels).backward()
    packed = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 and g.isfinite().all() for g in packed.values())
    model.zero_grad()
    a = model(tokens[:, :cut], labels=labels[:, :cut]) * (cut / 30)
    b = model(tokens[:, cut:], labels=labels[:, cut:]) * ((30 - cut) / 30)
    (a + b).backward()
    for key, p in model.named_parameters():
        torch.testing.assert_close(packed[key], p.grad, atol=1e-6, rtol=1e-4, msg=key)


# -- sizes and initialization ----------------------------------------------------------------

def test_debug_flavor_is_the_advertised_size():
    model = build_model("gpt_oss", "debug", device="meta")
    assert 2.0e6 < model.num_params() < 3.0e6 and model.num_active_params() < 0.6 * model.num_params()
    assert [model.args.layer_type(i) for i in range(4)] == ["sliding_attention", "full_attention"] * 2
    assert model.args.moe_ffn_dim == model.args.ffn_dim == 96


def test_init_starts_biases_and_sinks_at_zero():
    sd = build_model("gpt_oss", "debug", seed=0).state_dict()
    for key in ("layers.0.attention.sinks", "layers.0.attention.wq.bias", "layers.1.feed_forward.router.gate.bias",
                "layers.2.feed_forward.experts.b1", "layers.3.feed_forward.experts.b2"):
        assert not sd[key].any(), key
    depth_std = 0.02 / (2 * 4) ** 0.5
    assert abs(sd["layers.1.feed_forward.experts.w2"].std().item() - depth_std) < 0.1 * depth_std


def test_args_refuse_a_second_expert_width_and_no_experts():
    with pytest.raises(ForjaError, match=r"moe_ffn_dim=64 differs from model\.ffn_dim=96"):
        model_args("gpt_oss", "debug", moe_ffn_dim=64)
    with pytest.raises(ForjaError, match=r"n_experts=0: every gpt-oss block is a mixture of experts"):
        model_args("gpt_oss", "debug", n_experts=0)


# -- bad input -------------------------------------------------------------------------------

def test_a_config_without_rope_settings_takes_transformers_default(checkpoints, tmp_path):
    dst = checks.edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt", rope_parameters=None)
    s = load_hf_checkpoint(dst).args.rope_scaling
    assert (s.factor, s.original_max_seq_len, s.beta_fast, s.beta_slow, s.truncate) == (32.0, 4096, 32.0, 1.0, False)
    assert transformers.AutoConfig.from_pretrained(dst).rope_parameters["original_max_position_embeddings"] == 4096
