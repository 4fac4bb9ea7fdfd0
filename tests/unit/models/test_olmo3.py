"""OLMo 3 against transformers: same weights, same logits, both ways, over sequences longer
than the sliding window; both config.json dialects (YaRN on the full blocks only); greedy
decoding through the cache; published sizes; FLOPs; refusals. Tensor parallelism (QK-norm
over all heads): test_tp_families.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from forja.models.olmo3.hf import config_from_args
from tests.helpers import max_logit_diff
from tests.unit.models.family_checks import (assert_greedy_equal, check_logits, check_save_round_trip,
                                             checkpoint_fixtures, edited_checkpoint, hf_meta_params, random_hf_model,
                                             random_tokens)
from tests.unit.models.test_flops import measured_flops_per_token

transformers = pytest.importorskip("transformers")

# Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
# Measured: 0.0 for "debug" and "yarn" (the same ops in the same order).
TOL = 1e-5

_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6,
              sliding_window=8, pad_token_id=1, eos_token_id=2)
# name -> (config kwargs, the forja flavor it equals or None).
CONFIGS = {
    # The `debug` flavor: window 8, layers sliding, sliding, sliding, full; GQA 2:1.
    "debug": (dict(_SHAPE, rope_theta=500_000.0), "debug"),
    # YaRN on the full blocks (another base there; the sliding blocks keep 500,000 and no
    # scaling), a window of 5, another pattern, multi-head, tied embeddings.
    "yarn": (dict(_SHAPE, num_hidden_layers=5, num_key_value_heads=4, sliding_window=5, tie_word_embeddings=True,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention"], rope_theta=10_000.0, max_position_embeddings=64,
                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                    beta_fast=32.0, beta_slow=1.0)), None),
}


def make_hf_model(name: str, seed: int = 0):
    # transformers starts every norm at 1; make each one tell
    return random_hf_model("Olmo3ForCausalLM", CONFIGS[name][0], seed, pick=lambda key, p: "norm" in key,
                           draw=lambda p: p.normal_(1.0, 0.3))


checkpoints, loaded = checkpoint_fixtures(make_hf_model, CONFIGS)


_tokens = functools.partial(random_tokens, vocab_size=_SHAPE["vocab_size"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_matches_transformers_logits(checkpoints, loaded, name):
    # 40 tokens: five windows of 8
    check_logits(checkpoints[name][1], loaded[name], _tokens(40), TOL, family="olmo3", flavor=CONFIGS[name][1],
                 label=name)


def test_the_norm_spans_all_heads_and_blocks_are_post_norm(loaded):
    block = loaded["debug"].layers["0"]
    assert block.attention.q_norm.weight.shape == (4 * 32,) and block.attention.k_norm.weight.shape == (2 * 32,)
    assert not hasattr(block, "attention_norm") and hasattr(block, "post_ffn_norm")


def test_yarn_scales_the_full_blocks_only(loaded):
    model, positions = loaded["yarn"], torch.arange(12)
    a = model.args
    assert (a.rope_theta, a.local_rope_theta, a.rope_scaling.factor) == (10_000.0, 500_000.0, 4.0)
    full, sliding = model.rope_tables_for("full_attention", positions), model.rope_tables_for("sliding_attention",
                                                                                            positions)
    assert not torch.allclose(full[0], sliding[0])
    assert torch.equal(sliding[0][1, :16], torch.cos(500_000.0 ** (-torch.arange(0, 32, 2) / 32.0)))


def test_the_released_config_dialect_reads_the_same(checkpoints, loaded, tmp_path):
    """allenai's config.json holds rope_theta and rope_scaling at the top level."""
    src = checkpoints["yarn"][0]
    full = json.loads((src / "config.json").read_text())["rope_parameters"]["full_attention"]
    dst = edited_checkpoint(src, tmp_path / "ckpt", drop=("rope_parameters",), rope_theta=full.pop("rope_theta"),
                            rope_scaling=full)
    assert load_hf_checkpoint(dst).args == loaded["yarn"].args
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert max_logit_diff(hf, loaded["yarn"], _tokens(30)) < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_round_trips_bit_exact_and_transformers_reads_it(checkpoints, loaded, tmp_path, name):
    check_save_round_trip(loaded[name], tmp_path / "export", hf_class="Olmo3ForCausalLM", tokens=_tokens(33),
                          tol=TOL, layout_of=checkpoints[name][0])


def test_forja_model_exports_to_transformers(tmp_path):
    model = build_model("olmo3", "debug", seed=3)
    save_hf_checkpoint(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert max_logit_diff(hf, model, _tokens(20)) < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_decoding_equals_transformers_generate(checkpoints, loaded, name):
    # 9 + 12 = 21 positions: the cache holds more than two windows of 8 (four of 5), and the
    # 9-token prompt already fills one, so each of the 12 steps decodes past a window.
    assert_greedy_equal(checkpoints[name][1], loaded[name], _tokens(9, seed=4), 12)


# -- published sizes and FLOPs ---------------------------------------------------------------

# Equal to transformers' count for the same config.json (built on the meta device below).
PUBLISHED = {"7b": 7_298_011_136, "32b": 32_233_522_176}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts_equal_transformers(flavor):
    model = build_model("olmo3", flavor, device="meta")
    assert model.num_params() == PUBLISHED[flavor]
    assert model.num_params() == hf_meta_params(config_from_args(model.args))
    assert model.args.layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",)


def test_debug_flavor_is_the_advertised_size():
    assert 1.2e6 < build_model("olmo3", "debug", device="meta").num_params() < 1.4e6


def test_flops_formula_within_5_percent_of_counted():
    model = build_model("olmo3", "debug")
    T = model.args.sliding_window  # every block sees all T keys: the dense mask's count is the kernel's
    measured = measured_flops_per_token(model, 2, T)
    ratio = model.flops_per_token(T) / measured
    print(f"olmo3 debug T={T}: formula/measured = {ratio:.4f}")
    assert abs(ratio - 1) < 0.05
    a = model.args  # past the window the three sliding blocks stop counting new keys
    assert model.flops_per_token(64) - model.flops_per_token(32) == 12 * a.n_heads * a.head_dim * 32


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
     r"rope_scaling\.rope_type='dynamic' is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}),
     r"rope_parameters\.sliding_attention\.rope_type='linear' is not supported"),
])
def test_unsupported_config_option_is_named(checkpoints, tmp_path, changes, message):
    dst = edited_checkpoint(checkpoints["debug"][0], tmp_path / "ckpt", **changes)
    with pytest.raises(ForjaError, match=r"config\.json: " + message):
        load_hf_checkpoint(dst)


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(qk_norm=False), "qk_norm"), (dict(attention_sinks=True), "attention_sinks"),
    (dict(head_dim=16), "head_dim"),
])
def test_export_refuses_what_transformers_cannot_express(tmp_path, overrides, field):
    model = build_model("olmo3", "debug", device="meta", **overrides)
    with pytest.raises(ForjaError, match=f"an OLMo 3 with {field}="):
        save_hf_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()
