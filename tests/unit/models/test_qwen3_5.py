"""Qwen3.5 and Qwen3.5-MoE against transformers: the hybrid of Gated DeltaNet and gated
attention with the same weights gives the same logits, both ways; packed documents; the
multimodal checkpoint's text model; greedy decoding through the cache; published sizes;
refusals of what forja cannot represent; the MTP module's tensors. Tensor parallelism:
test_tp_families.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args, save_hf_checkpoint
from forja.models.qwen3_5.hf import config_from_args
from tests.helpers import max_logit_diff
from tests.unit.models.family_checks import (assert_greedy_equal, assert_same_weights, check_save_round_trip,
                                             checkpoint_fixtures, edited_checkpoint, float64_diffs, hf_meta_params,
                                             random_hf_model, random_tokens, stored_names)

transformers = pytest.importorskip("transformers")

# Bounds on max |logit difference| against transformers 5.24, torch 2.13, CPU. In float64
# the two compute the same function: measured 0 (dense) and below 1e-13. In float32 the
# chunked delta rule rounds differently from transformers' (a triangular solve where it
# loops over rows; each Gated DeltaNet layer's output differs by 1-2 ulp), and these small
# peaked models amplify a layer's rounding through the stack: measured 6.7e-6 (dense) and
# 2.0e-5 (moe), where transformers' own float32 logits are 1.1e-4 from its float64 ones. So
# float32 is held to 1e-5 where the model allows (the dense ones), and everywhere to
# transformers' own float32 rounding error. float64 is not compared for the MoE model: both
# route in float32 whatever the model's dtype (forja from float32 logits, transformers from
# float64 ones), which moves its expert outputs by ~1e-6 there.
TOL = 1e-5
TOL_FLOAT64 = 1e-10

_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
# name -> (transformers class, config kwargs, the forja flavor it equals or None).
CONFIGS = {
    "dense": ("Qwen3_5ForCausalLM", dict(_SHAPE, intermediate_size=384, tie_word_embeddings=True), "debug"),
    "moe": ("Qwen3_5MoeForCausalLM", dict(_SHAPE, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=64, shared_expert_intermediate_size=64),
            "debug-moe"),
    # Another pattern (linear, full, linear, full, linear), full attention every other block.
    "dense_alternating": ("Qwen3_5ForCausalLM", dict(
        _SHAPE, num_hidden_layers=5, intermediate_size=256, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"]), None),
}


def make_hf_model(name: str, seed: int = 0):
    cls_name, kwargs, _ = CONFIGS[name]
    # zero-centered norms start at 0 (scale 1): give them values of their own
    return random_hf_model(cls_name, kwargs, seed, pick=lambda key, p: p.dim() == 1,
                           draw=lambda p: p.add_(torch.randn_like(p) * 0.1))


checkpoints, loaded = checkpoint_fixtures(make_hf_model, CONFIGS)


_tokens = functools.partial(random_tokens, vocab_size=_SHAPE["vocab_size"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_matches_transformers_logits(checkpoints, loaded, name):
    hf = checkpoints[name][1]
    model = loaded[name]
    flavor = CONFIGS[name][2]
    if flavor is not None:  # config.json read into exactly the flavor's args
        assert model.args == model_args("qwen3_5", flavor)
    tokens = _tokens(80)  # two 64-token chunks of the delta rule (padded to whole chunks: 65 would cost the same)
    diff = max_logit_diff(hf, model, tokens)
    hf.config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    hf_rounding, diff64, *_ = float64_diffs(hf, model, tokens)
    print(f"{name}: max |logit diff| float32 {diff:.3e} (transformers' own float32 error {hf_rounding:.3e}), "
          f"float64 {diff64:.3e}")
    assert diff < hf_rounding
    if "moe" not in name:
        assert diff < TOL and diff64 < TOL_FLOAT64


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_round_trips_bit_exact_and_transformers_reads_it(checkpoints, loaded, tmp_path, name):
    check_save_round_trip(loaded[name], tmp_path / "export", hf_class=CONFIGS[name][0],
                          tokens=_tokens(33), tol=TOL)


def test_fused_expert_layout_loads_the_same(checkpoints, loaded, tmp_path):
    hf = checkpoints["moe"][1]
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)  # transformers 5's own layout
    assert "model.layers.1.mlp.experts.gate_up_proj" in stored_names(tmp_path / "fused")
    assert_same_weights(load_hf_checkpoint(tmp_path / "fused"), loaded["moe"])


def test_the_multimodal_checkpoints_text_model_loads(checkpoints, tmp_path):
    """The published Qwen3.5 checkpoints are multimodal: the text config under text_config,
    its tensors under model.language_model., a vision tower beside it."""
    path, hf = checkpoints["dense"]
    tensors = load_file(path / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)  # not read
    (tmp_path / "mm").mkdir()
    save_file(renamed, tmp_path / "mm" / "model.safetensors")
    text = json.loads((path / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": text, "vision_config": {"depth": 1}}
    (tmp_path / "mm" / "config.json").write_text(json.dumps(config))
    model = load_hf_checkpoint(tmp_path / "mm")
    assert max_logit_diff(hf, model, _tokens(20)) < TOL


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_decoding_equals_transformers_generate(checkpoints, loaded, name):
    hf = checkpoints[name][1]
    assert_greedy_equal(hf, loaded[name], _tokens(9, seed=4), 20)


@torch.no_grad()
def test_packed_documents_equal_each_document_alone():
    model = build_model("qwen3_5", "debug", seed=1).eval()
    a, b = _tokens(30, seed=5)[:1], _tokens(21, seed=6)[:1]
    packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 30 + [1] * 21]))
    torch.testing.assert_close(packed[:, 30:], model(b), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, :30], model(a), atol=2e-5, rtol=1e-5)


def test_a_training_step_reaches_every_parameter():
    model = build_model("qwen3_5", "debug-moe", seed=2)
    tokens = _tokens(24)
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


# -- published sizes -------------------------------------------------------------------------

# (total, active per token); equal to transformers' count for the same config.json.
PUBLISHED = {
    "9b": (8_953_803_264, 8_953_803_264),
    "35b-a3b": (34_660_610_688, 3_454_988_928),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts_equal_transformers(flavor):
    model = build_model("qwen3_5", flavor, device="meta")
    total, active = model.num_params(), model.num_active_params()
    print(f"{flavor}: {total:,} total, {active:,} active")
    assert total == hf_meta_params(config_from_args(model.args))
    assert (total, active) == PUBLISHED[flavor]


# -- what forja cannot represent ---------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    (dict(attention_bias=True), "attention_bias=True is not supported by forja's Qwen3.5"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types='sliding_attention'"),
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e7}), "rope_type='longrope'"),
])
def test_unsupported_config_option_is_named(checkpoints, tmp_path, changes, message):
    edited_checkpoint(checkpoints["dense"][0], tmp_path, **changes)
    with pytest.raises(ForjaError, match=message):
        load_hf_checkpoint(tmp_path)


def test_export_refuses_what_transformers_cannot_express(tmp_path):
    with pytest.raises(ForjaError, match="with attention_sinks=True has no equivalent in transformers"):
        save_hf_checkpoint(build_model("qwen3_5", "debug", attention_sinks=True), tmp_path)


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_the_mtp_module_saves_under_the_published_names_and_loads_back(tmp_path, flavor):
    """The published checkpoints carry one MTP module (`mtp.*`, which transformers skips)."""
    model = build_model("qwen3_5", flavor, seed=4, mtp_depth=1)
    out = save_hf_checkpoint(model, tmp_path / "export")
    names = stored_names(out)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.input_layernorm.weight"} <= names
    assert ("mtp.layers.0.mlp.shared_expert_gate.weight" in names) == (flavor == "debug-moe")
    back = load_hf_checkpoint(out)
    assert back.args.mtp_depth == 1
    assert_same_weights(model, back)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # the main model; mtp.* skipped
    assert max_logit_diff(reloaded, model, _tokens(20)) < 1e-4  # within transformers' own float32 rounding (above)
    fresh = build_model("qwen3_5", flavor, seed=4, mtp_depth=1).mtp.layers["4"]
    assert not fresh.hnorm.weight.any() and not fresh.norm.weight.any()  # zero-centered: zeros, a scale of one


def test_a_config_counting_an_mtp_module_transformers_did_not_save(checkpoints, tmp_path):
    edited_checkpoint(checkpoints["dense"][0], tmp_path, mtp_num_hidden_layers=1)
    model = load_hf_checkpoint(tmp_path)
    assert model.mtp is None and model.args.mtp_depth == 0  # the main model, as transformers loads it
