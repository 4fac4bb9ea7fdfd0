"""Qwen3 and Qwen3-MoE against transformers: the conformance CASE (dense and MoE blocks, the
released per-expert and transformers 5's fused expert layouts, published sizes, refusals) and
what is Qwen3's own: which blocks are mixtures of experts, the experts' initialization and
checkpoint layout, damaged expert tensors named. Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6,
              rope_theta=1_000_000.0)
_MOE = "Qwen3MoeForCausalLM"
_FUSED = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")

CASE = checks.FamilyCase(
    family="qwen3",
    configs={
        # The `debug` flavor: head_dim 64 != 128 / 4 heads, GQA 2:1, tied embeddings.
        "dense": checks.HFConfig("Qwen3ForCausalLM", dict(_SHAPE, head_dim=64, tie_word_embeddings=True), "debug"),
        # The `debug-moe` flavor: 8 experts, top 2, renormalized; layer 0 dense (mlp_only_layers).
        "moe": checks.HFConfig(_MOE, dict(_SHAPE, head_dim=32, tie_word_embeddings=False, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                          mlp_only_layers=[0]), "debug-moe"),
        # Every other block sparse, top 3 not renormalized, another eps and theta.
        "moe_step2": checks.HFConfig(_MOE, dict(
            _SHAPE, head_dim=32, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2, rms_norm_eps=1e-5,
            rope_theta=10_000.0)),
    },
    # Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
    # Measured: 0.0 for "dense" and "moe" (the same ops in the same order, experts included),
    # 2.4e-6 for "moe_step2": transformers runs an expert's gate and up projections as one
    # (2H, D) matmul, forja as two (H, D) ones, and BLAS rounds the two shapes differently
    # (1-2e-7 on an expert's output when H = 48; identical when H = 64).
    tol=1e-5,
    # float64: transformers' RMSNorms and the MoE's router (softmax in float32 whatever the
    # dtype) in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("qwen3.Qwen3RMSNorm.forward", "qwen3_moe.Qwen3MoeRMSNorm.forward",
                  "qwen3_moe.Qwen3MoeTopKRouter.forward"),
    layout=checks.stored_names,  # the released (per-expert) layout
    greedy={"dense": 24, "moe": 24},
    export_flavors=("debug", "debug-moe"),
    # (total, active per token), tied weights once; equal to transformers' count for the same
    # config.json (built on the meta device) and to the released models' reported sizes.
    published={
        "0.6b": (596_049_920, 596_049_920),
        "1.7b": (1_720_574_976, 1_720_574_976),
        "4b": (4_022_468_096, 4_022_468_096),
        "8b": (8_190_735_360, 8_190_735_360),
        "14b": (14_768_307_200, 14_768_307_200),
        "32b": (32_762_123_264, 32_762_123_264),
        "30b-a3b": (30_532_122_624, 3_353_032_704),
        "235b-a22b": (235_093_634_560, 22_190_763_520),
    },
    fused={"moe": _FUSED, "moe_step2": _FUSED},
    refusals=(
        ("dense", dict(attention_bias=True), r"attention_bias=True is not supported"),
        ("dense", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        ("dense", dict(use_sliding_window=True, sliding_window=64), r"use_sliding_window=True is not supported"),
        ("dense", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6,
                                        "original_max_position_embeddings": 512}),
         r"rope_parameters\.rope_type='longrope' is not supported"),
        ("dense", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type='dynamic'"),
        ("moe", dict(shared_expert_intermediate_size=256), r"shared_expert_intermediate_size=256 is not supported"),
        ("moe", dict(scoring_func="sigmoid"), r"scoring_func='sigmoid' is not supported"),
    ),
    export_refusals=tuple((overrides, f"a Qwen3 with {field}=") for overrides, field in [
        (dict(qk_norm=False), "qk_norm"), (dict(sliding_window=64), "sliding_window"),
        (dict(score_func="sigmoid"), "score_func"), (dict(n_shared_experts=1), "n_shared_experts")]),
    refusal_flavor="debug-moe",
)

checkpoints, loaded = checks.family_fixtures(CASE)


def test_transformers_saves_one_tensor_per_expert(checkpoints):
    names = checks.stored_names(checkpoints["moe"][0])
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)


def test_small_flavors_are_the_advertised_size():
    dense, moe = build_model("qwen3", "debug", device="meta"), build_model("qwen3", "debug-moe", device="meta")
    assert 1.0e6 < dense.num_params() < 1.5e6
    assert 1.2e6 < moe.num_params() < 1.7e6 and moe.num_active_params() < 0.75 * moe.num_params()
    kinds = [type(block.feed_forward).__name__ for block in moe.layers.values()]
    assert kinds == ["SwiGLU", "MoE", "MoE", "MoE"]


def test_moe_layer_rule_follows_sparse_step_and_mlp_only_layers():
    args = model_args("qwen3", "debug-moe", n_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [args.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ForjaError, match="no block is a mixture of experts"):
        model_args("qwen3", "debug-moe", mlp_only_layers=[0, 1, 2, 3])


def test_init_rules_scale_the_experts_outputs_with_depth():
    model = build_model("qwen3", "debug-moe", seed=0)
    sd = model.state_dict()
    depth_std = 0.02 / (2 * 4) ** 0.5
    assert abs(sd["layers.1.feed_forward.experts.w2"].std().item() - depth_std) < 0.1 * depth_std
    for key in ("layers.1.feed_forward.experts.w1", "layers.2.feed_forward.router.gate.weight"):
        assert abs(sd[key].std().item() - 0.02) < 0.002
    assert torch.equal(sd["layers.3.attention.q_norm.weight"], torch.ones(32))


# -- bad input -------------------------------------------------------------------------------


def test_missing_expert_is_named(checkpoints, tmp_path):
    dst = checks.edited_checkpoint(checkpoints["moe"][0], tmp_path / "ckpt",
                            edit_tensors=lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight is missing"):
        load_hf_checkpoint(dst)


def test_misshapen_expert_and_extra_expert_are_named(checkpoints, tmp_path):
    misshapen = {"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(128, 63)}
    dst = checks.edited_checkpoint(checkpoints["moe"][0], tmp_path / "ckpt", edit_tensors=lambda t: t.update(misshapen))
    with pytest.raises(ForjaError, match=r"experts\.0\.down_proj\.weight has shape \[128, 63\]; .* expects \[128, 64"):
        load_hf_checkpoint(dst)
    extra = {"model.layers.1.mlp.experts.8.gate_proj.weight": torch.zeros(64, 128)}
    dst = checks.edited_checkpoint(checkpoints["moe"][0], tmp_path / "extra", edit_tensors=lambda t: t.update(extra))
    with pytest.raises(ForjaError, match=r"unexpected tensor model\.layers\.1\.mlp\.experts\.8\.gate_proj\.weight"):
        load_hf_checkpoint(dst)


def test_damaged_fused_checkpoint_is_reported_in_its_own_layout(checkpoints, tmp_path):
    _, hf = checkpoints["moe"]
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    dst = checks.edited_checkpoint(tmp_path / "fused", tmp_path / "damaged",
                            edit_tensors=lambda t: t.pop("model.layers.3.mlp.experts.down_proj"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.3\.mlp\.experts\.down_proj is missing"):
        load_hf_checkpoint(dst)
