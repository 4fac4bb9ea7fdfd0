"""Mixtral against transformers: the conformance CASE (the released `block_sparse_moe`
per-expert and transformers 5's fused layouts, sliding windows, published sizes, refusals) and
what is Mixtral's own: the window reaching the args, its experts being its only feed-forward,
the router options read by nothing, damaged experts named. Tensor parallelism:
test_tp_families.py."""

from __future__ import annotations

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-5,
              rope_theta=1_000_000.0, num_local_experts=8, num_experts_per_tok=2)
_FUSED = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
          "model.layers.1.mlp.gate.weight")


def _window_is_written(name, model, reloaded, checkpoints) -> None:
    assert reloaded.config.sliding_window == model.args.sliding_window


CASE = checks.FamilyCase(
    family="mixtral",
    configs={
        # The `debug` flavor: 8 experts, top 2, GQA 2:1, no window.
        "base": checks.HFConfig("MixtralForCausalLM", _SHAPE, "debug"),
        # A 16-token sliding window (shorter than the sequences below), head_dim 64 != 128 / 4,
        # 4 experts, top 1, another eps and theta.
        "window": checks.HFConfig("MixtralForCausalLM", dict(
            _SHAPE, sliding_window=16, head_dim=64, num_local_experts=4, num_experts_per_tok=1, rms_norm_eps=1e-6,
            rope_theta=10_000.0, intermediate_size=64)),
    },
    # Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
    # Measured: 0.0 for "base" and "window" (the same ops in the same order, experts included).
    # The margin is for other expert widths: transformers runs an expert's gate and up
    # projections as one (2H, D) matmul, forja as two (H, D) ones, which BLAS may round
    # differently (2.4e-6 at H = 48 in test_qwen3.py).
    tol=1e-5,
    # float64: transformers' router takes the softmax of router_logits.float() and forja's
    # scores at least in float32: both in float64 (tests/unit/models/float64_casts.py), the
    # RMSNorm too; measured 0 (2.7e-6 with transformers' router in float32).
    float64_kept=("mixtral.MixtralRMSNorm.forward", "mixtral.MixtralTopKRouter.forward"),
    layout=checks.stored_names,  # the released (per-expert) layout
    after_round_trip=_window_is_written,
    # "window": 9 + 12 tokens run 5 steps past the 16-token window, through transformers' sliding
    # cache (once past it, each further step decodes the same way: more tokens would add no case).
    greedy={"base": 12, "window": 12},
    # (total, active per token); equal to transformers' count for the same config.json (built on
    # the meta device) and to the released models' reported sizes (46.7B total, 12.9B active;
    # 141B total, 39B active).
    published={"8x7b": (46_702_792_704, 12_879_925_248), "8x22b": (140_620_634_112, 39_152_031_744)},
    fused={"base": _FUSED, "window": _FUSED},
    refusals=(
        ("base", dict(router_jitter_noise=0.01), r"router_jitter_noise=0\.01 is not supported"),
        ("base", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        ("base", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6,
                                       "original_max_position_embeddings": 512}),
         r"rope_parameters\.rope_type='longrope' is not supported"),
        ("base", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type='dynamic'"),
        ("base", dict(attention_bias=True), r"attention_bias=True is not supported"),
        ("base", dict(norm_topk_prob=False), r"norm_topk_prob=False is not supported"),
    ),
    export_refusals=tuple((overrides, f"a Mixtral with {field}=") for overrides, field in [
        (dict(qk_norm=True), "qk_norm"), (dict(score_func="sigmoid"), "score_func"),
        (dict(norm_topk_prob=False), "norm_topk_prob"), (dict(n_shared_experts=1), "n_shared_experts"),
        (dict(sliding_window=64, layer_types=["full_attention", "sliding_attention"] * 2), "layer_types"),
        (dict(capacity_factor=1.25), "capacity_factor")]),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def test_the_window_reaches_the_args(loaded):
    assert loaded["window"].args.sliding_window == 16 and loaded["window"].args.layer_type(3) == "sliding_attention"


def test_transformers_saves_the_released_layout(checkpoints):
    names = checks.stored_names(checkpoints["base"][0])
    assert {"model.layers.1.block_sparse_moe.experts.7.w1.weight", "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.3.block_sparse_moe.experts.0.w2.weight"} <= names
    assert not any("gate_up_proj" in n or ".mlp." in n for n in names)


# -- sizes -------------------------------------------------------------------------------------

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


def test_aux_loss_options_leave_the_model_alone(checkpoints, loaded, tmp_path):
    """output_router_logits / router_aux_loss_coef add a training loss only: read, not refused."""
    dst = checks.edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt", output_router_logits=True,
                            router_aux_loss_coef=0.02)
    assert load_hf_checkpoint(dst).args == loaded["base"].args


def test_missing_and_misshapen_experts_are_named(checkpoints, tmp_path):
    dst = checks.edited_checkpoint(checkpoints["base"][0], tmp_path / "ckpt",
                            edit_tensors=lambda t: t.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.2\.block_sparse_moe\.experts\.5\.w3\.weight is "
                                         r"missing"):
        load_hf_checkpoint(dst)
    bad = {"model.layers.1.block_sparse_moe.experts.0.w2.weight": torch.zeros(128, 95)}
    dst = checks.edited_checkpoint(checkpoints["base"][0], tmp_path / "bad", edit_tensors=lambda t: t.update(bad))
    with pytest.raises(ForjaError, match=r"experts\.0\.w2\.weight has shape \[128, 95\]; .* expects \[128, 96"):
        load_hf_checkpoint(dst)
