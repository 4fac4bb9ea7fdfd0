"""Qwen3.5 and Qwen3.5-MoE against transformers: the conformance CASE (the hybrid of Gated
DeltaNet and gated attention, float32 and float64; published sizes; refusals) and what is
Qwen3.5's own: the multimodal checkpoint's text model, packed documents, a training step, the
MTP module's tensors. Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})

CASE = checks.FamilyCase(
    family="qwen3_5",
    configs={
        "dense": checks.HFConfig("Qwen3_5ForCausalLM", dict(_SHAPE, intermediate_size=384, tie_word_embeddings=True),
                          "debug"),
        "moe": checks.HFConfig("Qwen3_5MoeForCausalLM", dict(_SHAPE, tie_word_embeddings=False, num_experts=8,
                                                      num_experts_per_tok=2, moe_intermediate_size=64,
                                                      shared_expert_intermediate_size=64), "debug-moe"),
        # Another pattern (linear, full, linear, full, linear), full attention every other block.
        "dense_alternating": checks.HFConfig("Qwen3_5ForCausalLM", dict(
            _SHAPE, num_hidden_layers=5, intermediate_size=256, tie_word_embeddings=False,
            layer_types=["linear_attention", "full_attention"] * 2 + ["linear_attention"])),
    },
    # zero-centered norms start at 0 (scale 1): give them values of their own
    pick=lambda key, p: p.dim() == 1, draw=lambda p: p.add_(torch.randn_like(p) * 0.1),
    # Bounds on max |logit difference| against transformers 5.25, torch 2.13, CPU (checks.hybrid_logits).
    # In float32 each Gated DeltaNet layer's output differs by 1-2 ulp, amplified through the
    # stack: measured 6.7e-6 (dense) and 2.0e-5 (moe), where transformers' own float32 logits
    # are 1.1e-4 from its float64 ones. In float64 the two compute the same function: measured 0
    # on every config (2.1e-5 with experts as they were). transformers computes the delta rule,
    # its decay, its RMSNorms (the gated one too) and the router's softmax in float32 whatever
    # the model's dtype, where forja computes them at least in float32: those run in float64
    # there (tests/unit/models/float64_casts.py), Qwen3.5's and Qwen3.5-MoE's modules alike.
    tol=1e-5, logits=checks.hybrid_logits,
    float64_kept=tuple(f"{m}.{name}" for m, p in (("qwen3_5", "Qwen3_5"), ("qwen3_5_moe", "Qwen3_5Moe")) for name in (
        f"{p}RMSNorm.forward", f"{p}RMSNormGated.forward", f"{p}GatedDeltaNet.forward", "torch_chunk_gated_delta_rule",
    )) + ("qwen3_5_moe.Qwen3_5MoeTopKRouter.forward",),
    tokens=80,  # two 64-token chunks of the delta rule (padded to whole chunks: 65 would cost the same)
    greedy={"dense": 20, "moe": 20},
    export_flavors=("debug", "debug-moe"),  # measured 3.9e-7 and 4.8e-7: forja's init keeps logits small
    # (total, active per token); equal to transformers' count for the same config.json.
    published={"9b": (8_953_803_264, 8_953_803_264), "35b-a3b": (34_660_610_688, 3_454_988_928)},
    fused={"moe": ("model.layers.1.mlp.experts.gate_up_proj",)},
    refusal_prefix="",
    refusals=(
        ("dense", dict(attention_bias=True), "attention_bias=True is not supported by forja's Qwen3.5"),
        ("dense", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("dense", dict(layer_types=["sliding_attention"] * 4), "layer_types='sliding_attention'"),
        ("dense", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e7}),
         "rope_type='longrope'"),
    ),
    export_refusals=((dict(attention_sinks=True), "with attention_sinks=True has no equivalent in transformers"),),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


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
    assert max_logit_diff(hf, model, _tokens(20)) < CASE.tol


# -- the multi-token prediction module ----------------------------------------------------------

@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_the_mtp_module_saves_under_the_published_names_and_loads_back(tmp_path, flavor):
    """The published checkpoints carry one MTP module (`mtp.*`, which transformers skips)."""
    model = build_model("qwen3_5", flavor, seed=4, mtp_depth=1)
    out = save_hf_checkpoint(model, tmp_path / "export")
    names = checks.stored_names(out)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.input_layernorm.weight"} <= names
    assert ("mtp.layers.0.mlp.shared_expert_gate.weight" in names) == (flavor == "debug-moe")
    back = load_hf_checkpoint(out)
    assert back.args.mtp_depth == 1
    checks.assert_same_weights(model, back)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # the main model; mtp.* skipped
    assert max_logit_diff(reloaded, model, _tokens(20)) < 1e-4  # within transformers' own float32 rounding (above)
    fresh = build_model("qwen3_5", flavor, seed=4, mtp_depth=1).mtp.layers["4"]
    assert not fresh.hnorm.weight.any() and not fresh.norm.weight.any()  # zero-centered: zeros, a scale of one


def test_a_config_counting_an_mtp_module_transformers_did_not_save(checkpoints, tmp_path):
    checks.edited_checkpoint(checkpoints["dense"][0], tmp_path, mtp_num_hidden_layers=1)
    model = load_hf_checkpoint(tmp_path)
    assert model.mtp is None and model.args.mtp_depth == 0  # the main model, as transformers loads it
