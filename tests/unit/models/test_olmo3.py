"""OLMo 3 against transformers: the conformance CASE (sequences longer than the sliding
window, post-norm blocks, QK-norm over all heads; published sizes; refusals) and what is
OLMo 3's own: its norms, YaRN on the full blocks only, the released config dialect, the
sliding/full pattern, FLOPs. Tensor parallelism (QK-norm over all heads): test_tp_families.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from forja.models import build_model, load_hf_checkpoint, model_args
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks
from tests.unit.models.test_flops import measured_flops_per_token

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6,
              sliding_window=8, pad_token_id=1, eos_token_id=2)

CASE = checks.FamilyCase(
    family="olmo3",
    configs={
        # The `debug` flavor: window 8, layers sliding, sliding, sliding, full; GQA 2:1.
        "debug": checks.HFConfig("Olmo3ForCausalLM", dict(_SHAPE, rope_theta=500_000.0), "debug"),
        # YaRN on the full blocks (another base there; the sliding blocks keep 500,000 and no
        # scaling), a window of 5, another pattern, multi-head, tied embeddings.
        "yarn": checks.HFConfig("Olmo3ForCausalLM", dict(
            _SHAPE, num_hidden_layers=5, num_key_value_heads=4, sliding_window=5, tie_word_embeddings=True,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"], rope_theta=10_000.0, max_position_embeddings=64,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
                              beta_slow=1.0))),
    },
    # transformers starts every norm at 1; make each one tell
    pick=lambda key, p: "norm" in key, draw=lambda p: p.normal_(1.0, 0.3),
    # Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
    # Measured: 0.0 for "debug" and "yarn" (the same ops in the same order).
    tol=1e-5,
    # float64: transformers' RMSNorm in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("olmo3.Olmo3RMSNorm.forward",),
    tokens=40,  # five windows of 8
    layout=checks.stored_names,
    # 9 + 12 = 21 positions: the cache holds more than two windows of 8 (four of 5), and the
    # 9-token prompt already fills one, so each of the 12 steps decodes past a window.
    greedy={"debug": 12, "yarn": 12},
    # Equal to transformers' count for the same config.json (built on the meta device).
    published={"7b": (7_298_011_136,), "32b": (32_233_522_176,)},
    refusals=(
        ("debug", dict(attention_bias=True), r"attention_bias=True is not supported"),
        ("debug", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        ("debug", dict(rope_parameters={
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
         r"rope_scaling\.rope_type='dynamic' is not supported"),
        ("debug", dict(rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}),
         r"rope_parameters\.sliding_attention\.rope_type='linear' is not supported"),
    ),
    export_refusals=tuple((overrides, f"an OLMo 3 with {field}=") for overrides, field in [
        (dict(qk_norm=False), "qk_norm"), (dict(attention_sinks=True), "attention_sinks"),
        (dict(head_dim=16), "head_dim")]),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


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
    dst = checks.edited_checkpoint(src, tmp_path / "ckpt", drop=("rope_parameters",), rope_theta=full.pop("rope_theta"),
                            rope_scaling=full)
    assert load_hf_checkpoint(dst).args == loaded["yarn"].args
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert max_logit_diff(hf, loaded["yarn"], _tokens(30)) < CASE.tol


# -- sizes and FLOPs ---------------------------------------------------------------------------

@pytest.mark.parametrize("flavor", list(CASE.published))
def test_published_flavors_slide_in_three_blocks_of_four(flavor):
    assert model_args("olmo3", flavor).layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",)


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
