"""Mixtral against transformers: same weights, same logits, both ways; the released
(`block_sparse_moe`, per-expert) and transformers 5's fused checkpoint layouts; sliding
windows; greedy decoding; published sizes; refusals of what forja cannot represent.
Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args, save_hf_checkpoint
from forja.models.mixtral.hf import config_from_args
from tests.helpers import max_logit_diff
from tests.unit.models.family_checks import (assert_greedy_equal, assert_same_weights, check_logits,
                                             check_save_round_trip, checkpoint_fixtures, edited_checkpoint,
                                             hf_meta_params, random_hf_model, random_tokens, stored_names)

transformers = pytest.importorskip("transformers")

# Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
# Measured: 0.0 for "base" and "window" (the same ops in the same order, experts included).
# The margin is for other expert widths: transformers runs an expert's gate and up
# projections as one (2H, D) matmul, forja as two (H, D) ones, which BLAS may round
# differently (2.4e-6 at H = 48 in test_qwen3.py).
TOL = 1e-5

_SHAPE = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-5,
              rope_theta=1_000_000.0, num_local_experts=8, num_experts_per_tok=2)
# name -> (config kwargs, the forja flavor it equals or None).
CONFIGS = {
    # The `debug` flavor: 8 experts, top 2, GQA 2:1, no window.
    "base": (_SHAPE, "debug"),
    # A 16-token sliding window (shorter than the sequences below), head_dim 64 != 128 / 4,
    # 4 experts, top 1, another eps and theta.
    "window": (dict(_SHAPE, sliding_window=16, head_dim=64, num_local_experts=4, num_experts_per_tok=1,
                    rms_norm_eps=1e-6, rope_theta=10_000.0, intermediate_size=64), None),
}


def make_hf_model(name: str, seed: int = 0):
    return random_hf_model("MixtralForCausalLM", CONFIGS[name][0], seed)


checkpoints, loaded = checkpoint_fixtures(make_hf_model, CONFIGS)


_tokens = functools.partial(random_tokens, vocab_size=_SHAPE["vocab_size"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_matches_transformers_logits(checkpoints, loaded, name):
    model, flavor = loaded[name], CONFIGS[name][1]
    if flavor is None:
        assert model.args.sliding_window == 16 and model.args.layer_type(3) == "sliding_attention"
    check_logits(checkpoints[name][1], model, _tokens(48), TOL, family="mixtral", flavor=flavor, label=name)


def test_transformers_saves_the_released_layout(checkpoints):
    names = stored_names(checkpoints["base"][0])
    assert {"model.layers.1.block_sparse_moe.experts.7.w1.weight", "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.3.block_sparse_moe.experts.0.w2.weight"} <= names
    assert not any("gate_up_proj" in n or ".mlp." in n for n in names)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_expert_layout_loads_the_same(checkpoints, loaded, tmp_path, name):
    hf = checkpoints[name][1]
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)  # transformers 5's own layout
    names = stored_names(tmp_path / "fused")
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
            "model.layers.1.mlp.gate.weight"} <= names
    assert_same_weights(load_hf_checkpoint(tmp_path / "fused"), loaded[name])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_round_trips_bit_exact_and_transformers_reads_it(checkpoints, loaded, tmp_path, name):
    model = loaded[name]
    # layout_of: the released (per-expert) layout
    _, reloaded = check_save_round_trip(model, tmp_path / "export", hf_class="MixtralForCausalLM",
                                        tokens=_tokens(33), tol=TOL, layout_of=checkpoints[name][0])
    assert reloaded.config.sliding_window == model.args.sliding_window


def test_forja_model_exports_to_transformers(tmp_path):
    model = build_model("mixtral", "debug", seed=3)
    save_hf_checkpoint(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert max_logit_diff(hf, model, _tokens(20)) < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_decoding_equals_transformers_generate(checkpoints, loaded, name):
    # "window": 9 + 12 tokens run 5 steps past the 16-token window, through transformers' sliding
    # cache (once past it, each further step decodes the same way: more tokens would add no case).
    assert_greedy_equal(checkpoints[name][1], loaded[name], _tokens(9, seed=4), 12)


# -- published sizes -------------------------------------------------------------------------

# (total, active per token); equal to transformers' count for the same config.json (built on
# the meta device below) and to the released models' reported sizes (46.7B total, 12.9B
# active; 141B total, 39B active).
PUBLISHED = {
    "8x7b": (46_702_792_704, 12_879_925_248),
    "8x22b": (140_620_634_112, 39_152_031_744),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts_equal_transformers(flavor):
    model = build_model("mixtral", flavor, device="meta")
    assert (model.num_params(), model.num_active_params()) == PUBLISHED[flavor]
    assert model.num_params() == hf_meta_params(config_from_args(model.args))


def test_debug_flavor_is_the_advertised_size():
    model = build_model("mixtral", "debug", device="meta")
    assert 1.5e6 < model.num_params() < 2.0e6 and model.num_active_params() < 0.6 * model.num_params()
    assert [type(block.feed_forward).__name__ for block in model.layers.values()] == ["MoE"] * 4
    assert model.args.moe_ffn_dim == model.args.ffn_dim == 96


def test_args_refuse_a_second_expert_width_and_no_experts():
    with pytest.raises(ForjaError, match=r"moe_ffn_dim=64 differs from model\.ffn_dim=96"):
        model_args("mixtral", "debug", moe_ffn_dim=64)
    with pytest.raises(ForjaError, match=r"n_experts=0: every Mixtral block is a mixture of experts"):
        model_args("mixtral", "debug", n_experts=0)


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    (dict(router_jitter_noise=0.01), r"router_jitter_noise=0\.01 is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6,
                           "original_max_position_embeddings": 512}),
     r"rope_parameters\.rope_type='longrope' is not supported"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type='dynamic'"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(norm_topk_prob=False), r"norm_topk_prob=False is not supported"),
])
def test_unsupported_config_option_is_named(checkpoints, tmp_path, changes, message):
    dst = edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt", **changes)
    with pytest.raises(ForjaError, match=r"config\.json: " + message):
        load_hf_checkpoint(dst)


def test_aux_loss_options_leave_the_model_alone(checkpoints, loaded, tmp_path):
    """output_router_logits / router_aux_loss_coef add a training loss only: read, not refused."""
    dst = edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt", output_router_logits=True,
                            router_aux_loss_coef=0.02)
    assert load_hf_checkpoint(dst).args == loaded["base"].args


def test_missing_and_misshapen_experts_are_named(checkpoints, tmp_path):
    dst = edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt",
                            edit_tensors=lambda t: t.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.2\.block_sparse_moe\.experts\.5\.w3\.weight is "
                                         r"missing"):
        load_hf_checkpoint(dst)
    bad = {"model.layers.1.block_sparse_moe.experts.0.w2.weight": torch.zeros(128, 95)}
    dst = edited_checkpoint(checkpoints["base"][0], tmp_path / "bad", edit_tensors=lambda t: t.update(bad))
    with pytest.raises(ForjaError, match=r"experts\.0\.w2\.weight has shape \[128, 95\]; .* expects \[128, 96"):
        load_hf_checkpoint(dst)


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(qk_norm=True), "qk_norm"), (dict(score_func="sigmoid"), "score_func"),
    (dict(norm_topk_prob=False), "norm_topk_prob"), (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(sliding_window=64, layer_types=["full_attention", "sliding_attention"] * 2), "layer_types"),
    (dict(capacity_factor=1.25), "capacity_factor"),
])
def test_export_refuses_what_transformers_cannot_express(tmp_path, overrides, field):
    model = build_model("mixtral", "debug", device="meta", **overrides)
    with pytest.raises(ForjaError, match=f"a Mixtral with {field}="):
        save_hf_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()
