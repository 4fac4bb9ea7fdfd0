"""OLMo-Hybrid against transformers: the conformance CASE (Gated DeltaNet blocks, pre-norm,
and OLMo 3's post-norm attention blocks, float32 and float64; the published size; refusals)
and what is OLMo-Hybrid's own: every checkpoint layout transformers 5.24 writes, packed
documents, a training step, its initialization ranges, FLOPs. Tensor parallelism:
test_tp_families.py."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.models import build_model, load_hf_checkpoint, model_args, save_hf_checkpoint
from forja.models.olmo_hybrid.hf import config_from_args
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks
from tests.unit.models.test_flops import measured_flops_per_token

transformers = pytest.importorskip("transformers")

# Bounds on max |logit difference| against transformers 5.25, torch 2.13, CPU, 80 tokens
# (more than one 64-token chunk of the delta rule). float32: measured 8.0e-6 in both
# configs, transformers' own float32 logits being 2.4e-5 and 2.2e-5 from its float64 ones.
# float64: transformers runs the gated delta rule (torch_chunk_gated_delta_rule), its decay
# and its RMSNorms in float32 whatever the model's dtype, where forja computes them at least
# in float32; in the float64 comparison those run in float64 (tests/unit/models/float64_casts.py,
# the CASE's float64_kept): measured 0 in both configs (8.3e-6 and 8.5e-6 as they were).
TOL = 1e-5

_SHAPE = dict(hidden_size=128, num_attention_heads=4, vocab_size=2048, max_position_embeddings=2048,
              rms_norm_eps=1e-6, linear_conv_kernel_dim=4, pad_token_id=None, eos_token_id=None)


def _logits(case, name, hf, model, tokens, monkeypatch) -> tuple[float, float]:
    """float32 within TOL and transformers' own float32 error; float64 the same function."""
    flavor = case.configs[name].flavor
    if flavor is not None:  # config.json read into exactly the flavor's args
        assert model.args == model_args("olmo_hybrid", flavor)
    diff = max_logit_diff(hf, model, tokens)
    hf_rounding, diff64, *_, exact = checks.float64_diffs(hf, model, tokens, case)
    print(f"{name}: max |logit diff| float32 {diff:.3e} (transformers' own float32 error {hf_rounding:.3e}), "
          f"float64 {diff64:.3e}")
    assert exact.abs().max() > 1.0  # logits of some size, not a degenerate model
    assert diff < TOL and diff < hf_rounding
    assert diff64 < case.float64_tol
    return diff, diff64


CASE = checks.FamilyCase(
    family="olmo_hybrid",
    configs={
        # The published arrangement (3 Gated DeltaNet, 1 attention), NoPE, no grouping, value heads
        # twice as wide as key heads: forja's debug flavor.
        "debug": checks.HFConfig("OlmoHybridForCausalLM", dict(
            _SHAPE, num_hidden_layers=4, num_key_value_heads=4, intermediate_size=384, linear_num_key_heads=4,
            linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=48, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": None}), "debug"),
        # Another pattern, RoPE, GQA 2:1, tied embeddings, other Gated DeltaNet widths (q | k | v
        # channels 64 | 64 | 128, which transformers' save_pretrained stores in chunks of 86, 86, 84).
        "rope_gqa": checks.HFConfig("OlmoHybridForCausalLM", dict(
            _SHAPE, num_hidden_layers=5, num_key_value_heads=2, intermediate_size=256,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                         "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=64,
            linear_allow_neg_eigval=True, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})),
    },
    # norms start at ones: give them values of their own
    pick=lambda key, p: key.endswith("norm.weight"), draw=lambda p: p.add_(torch.randn_like(p) * 0.1),
    tol=TOL, logits=_logits,
    float64_kept=("olmo_hybrid.OlmoHybridRMSNorm.forward", "olmo_hybrid.OlmoHybridRMSNormGated.forward",
                  "olmo_hybrid.OlmoHybridGatedDeltaNet.forward", "olmo_hybrid.torch_chunk_gated_delta_rule"),
    tokens=80,  # two 64-token chunks of the delta rule (padded to whole chunks: 65 would cost the same)
    greedy={"debug": 20, "rope_gqa": 20},
    published={"7b": (7_430_870_688, 7_430_870_688)},  # equal to transformers' count for the same config.json
    refusal_prefix="",
    refusals=(
        ("debug", dict(attention_bias=True), "attention_bias=True is not supported by forja's OLMo-Hybrid"),
        ("debug", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("debug", dict(attention_dropout=0.1), "attention_dropout=0.1"),
        ("debug", dict(layer_types=["sliding_attention"] * 4), "layer_types='sliding_attention'"),
        ("debug", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
         "rope_type='longrope'"),
    ),
    export_refusals=(
        (dict(attention_sinks=True), "with attention_sinks=True has no equivalent in transformers"),
        (dict(sliding_window=16), "with sliding_window=16 has no equivalent"),
        (dict(qk_norm=False), "with qk_norm=False has no equivalent"),
    ),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


def test_every_layout_transformers_writes_loads_the_same(checkpoints, loaded, tmp_path):
    """save_pretrained's convolutions in equal thirds (the fixture's files), forja's at the
    projections' widths, and transformers' module layout (one conv1d, module-named norms)."""
    path, hf = checkpoints["rope_gqa"]
    thirds = checks.stored_shapes(path)
    # 256 channels in chunks of 86, not cut at the projections' 64 | 64 | 128
    assert thirds["model.layers.0.linear_attn.q_conv1d.weight"] == [86, 1, 4]
    assert "model.layers.0.attention_layer_norm.weight" in thirds
    ours = loaded["rope_gqa"]
    written = checks.stored_shapes(save_hf_checkpoint(ours, tmp_path / "forja"))
    assert [written[f"model.layers.0.linear_attn.{c}_conv1d.weight"][0] for c in "qkv"] == [64, 64, 128]
    hf.save_pretrained(tmp_path / "modules", save_original_format=False)
    modules = checks.stored_shapes(tmp_path / "modules")
    assert "model.layers.0.linear_attn.conv1d.weight" in modules
    assert "model.layers.0.input_layernorm.weight" in modules
    for other in (load_hf_checkpoint(tmp_path / "forja"), load_hf_checkpoint(tmp_path / "modules")):
        checks.assert_same_weights(other, ours)


def test_init_draws_the_decay_and_time_step_from_the_args_ranges():
    model = build_model("olmo_hybrid", "debug", seed=3, linear_a_log_min=1.0, linear_a_log_max=2.0,
                        linear_dt_min=0.01, linear_dt_max=0.02)
    mixer = model.layers["0"].attention
    A, dt = mixer.A_log.exp(), torch.nn.functional.softplus(mixer.dt_bias)
    assert A.min() >= 1.0 and A.max() <= 2.0 and A.std() > 0
    assert dt.min() >= 0.01 - 1e-7 and dt.max() <= 0.02 + 1e-7 and dt.std() > 0
    assert (mixer.norm.weight == 1).all() and (model.layers["3"].post_attention_norm.weight == 1).all()


def test_flops_formula_within_5_percent_of_counted():
    model = build_model("olmo_hybrid", "debug", rope_theta=10_000.0)
    ratio = model.flops_per_token(128) / measured_flops_per_token(model, 1, 128)
    print(f"olmo_hybrid T=128: formula/measured = {ratio:.4f}")
    assert abs(ratio - 1) < 0.05


# -- the published size ------------------------------------------------------------------------

def test_the_published_flavor_is_transformers_default_shape():
    args = model_args("olmo_hybrid", "7b")
    defaults = transformers.OlmoHybridConfig()
    assert config_from_args(args)["layer_types"] == defaults.layer_types
    assert (args.linear_k_head_dim, args.linear_v_head_dim) == (defaults.linear_key_head_dim,
                                                                  defaults.linear_value_head_dim)
