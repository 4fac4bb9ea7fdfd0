"""Kimi Linear against transformers: the conformance CASE (KDA and NoPE latent attention mixed, a
dense first block and DeepSeek-V3's mixture after, float32 and float64; the published size;
refusals) and what is Kimi Linear's own: config.json's dialects and layer lists, every layout
transformers writes, the KDA blocks' init, FLOPs. Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from forja.models.kimi_linear.hf import args_from_config, config_from_args
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks
from tests.unit.models.test_flops import measured_flops_per_token

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TOL_EXPERTS = 2e-5


def _logits(case, name, hf, model, tokens, monkeypatch) -> tuple[float, float]:
    """float32 within transformers' own float32 error and TOL (TOL_EXPERTS with experts); float64
    the same function, transformers' float32 pieces in float64 as forja's (the CASE's
    float64_kept: the KDA rule, which transformers loops over rows where forja solves a
    triangular system, its forget gate, norms and router)."""
    diff = max_logit_diff(hf, model, tokens)
    hf.config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    hf_rounding, diff64, *_, exact = checks.float64_diffs(hf, model, tokens, case)
    experts = any(model.args.is_moe_layer(i) for i in range(model.args.n_layers))
    print(f"{name}: max |logit diff| float32 {diff:.3e} (transformers' own float32 error {hf_rounding:.3e}), "
          f"float64 {diff64:.3e}")
    assert exact.abs().max() > 1.0  # logits of some size, not a degenerate model
    assert diff < hf_rounding and diff < (TOL_EXPERTS if experts else TOL)
    assert diff64 < case.float64_tol
    return diff, diff64


_SHAPE = dict(hidden_size=128, num_attention_heads=4, vocab_size=2048, intermediate_size=384,
              kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rms_norm_eps=1e-5,
              model_max_length=2048, pad_token_id=None, bos_token_id=None, eos_token_id=None)

CASE = checks.FamilyCase(
    family="kimi_linear",
    configs={
        # transformers' keys, the layer kinds listed (what test_random_configs.py draws around):
        # KDA in blocks 0-2, latent attention in block 3, block 0 dense, 8 experts top 2, no groups.
        "moe": checks.HFConfig("KimiLinearForCausalLM", dict(
            _SHAPE, num_hidden_layers=4, q_lora_rank=None, moe_intermediate_size=64,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_heads=2, linear_head_dim=32,
            first_k_dense_replace=1, num_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            tie_word_embeddings=False)),
        # The published arrangement in small, the published config.json's keys: KDA in blocks 1-3
        # and latent attention in block 4 (1-based lists), block 1 dense, 8 experts top 2 in 2
        # groups, a shared expert: forja's debug flavor.
        "debug": checks.HFConfig("KimiLinearForCausalLM", dict(
            _SHAPE, num_hidden_layers=4, q_lora_rank=None, moe_intermediate_size=64,
            linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 32, "num_heads": 2,
                                "short_conv_kernel_size": 4},
            first_k_dense_replace=1, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
            num_expert_group=2, topk_group=1, tie_word_embeddings=False), "debug"),
        # transformers' keys: another pattern, a query latent, every block dense (float64 exact),
        # other KDA widths, tied embeddings.
        "dense": checks.HFConfig("KimiLinearForCausalLM", dict(
            _SHAPE, num_hidden_layers=5, q_lora_rank=24, moe_intermediate_size=32,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                         "linear_attention"], mlp_layer_types=["dense"] * 5, linear_num_heads=4,
            linear_head_dim=16, linear_conv_kernel_dim=3, tie_word_embeddings=True)),
    },
    # norms start at ones: give them values of their own
    pick=lambda key, p: key.endswith("norm.weight"), draw=lambda p: p.add_(torch.randn_like(p) * 0.1),
    tol=TOL, logits=_logits,
    float64_kept=("kimi_linear.KimiLinearRMSNorm.forward", "kimi_linear.KimiLinearRMSNormGated.forward",
                  "kimi_linear.KimiLinearForgetGate.forward", "kimi_linear.chunk_kimi_delta_attention",
                  "kimi_linear.KimiLinearTopkRouter.forward"),
    tokens=80,  # more than one chunk of both sides' rules (transformers' 64, forja's 16)
    greedy={"debug": 20, "dense": 20},  # every kind of block: KDA, latent attention, dense, MoE
    # (total, active per token); equal to transformers' count for the same config.json.
    published={"48b-a3b": (49_122_675_072, 3_484_453_248)},
    refusal_prefix="",
    refusals=(
        ("debug", dict(attention_bias=True), "attention_bias=True is not supported by forja's Kimi Linear"),
        ("debug", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("debug", dict(num_shared_experts=0), "num_shared_experts=0"),
    ),
    export_refusals=(
        (dict(score_func="softmax"), "Kimi Linear with score_func='softmax' has no equivalent in transformers"),
        (dict(qk_norm=True), "with qk_norm=True has no equivalent"),
    ),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


def test_the_published_config_json_reads_into_the_flavor():
    """moonshotai/Kimi-Linear-48B-A3B's config.json keys (1-based layer lists, the checkpoint's
    names for the routing options) give the 48b-a3b flavor, and forja writes them back."""
    published = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
        "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "hidden_act": "silu",
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True, "rope_theta": 10000.0, "rope_scaling": None,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
        "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
        "moe_router_activation_func": "sigmoid", "model_max_length": 1048576, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "pad_token_id": 163839,
    }
    args = build_model("kimi_linear", "48b-a3b", device="meta").args
    assert args_from_config(published) == args
    written = config_from_args(args)
    assert written["linear_attn_config"] == published["linear_attn_config"]
    assert written["first_k_dense_replace"] == 1 and args_from_config(written) == args


def test_every_layout_transformers_writes_loads_the_same(checkpoints, loaded, tmp_path):
    """save_pretrained's (the fixture's: dense MLPs under block_sparse_moe), forja's (the published
    names) and transformers' module layout (fused experts, one conv1d, the forget gate's module)."""
    path, hf = checkpoints["debug"]
    saved = checks.stored_names(path)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in saved
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in saved
    ours = loaded["debug"]
    written = checks.stored_names(save_hf_checkpoint(ours, tmp_path / "forja"))
    assert "model.layers.0.mlp.gate_proj.weight" in written and "model.layers.0.self_attn.q_conv1d.weight" in written
    hf.save_pretrained(tmp_path / "modules", save_original_format=False)
    modules = checks.stored_names(tmp_path / "modules")
    assert {"model.layers.0.self_attn.conv1d.weight", "model.layers.0.self_attn.forget_gate.A_log",
            "model.layers.1.mlp.experts.gate_up_proj"} <= modules
    for other in (load_hf_checkpoint(tmp_path / "forja"), load_hf_checkpoint(tmp_path / "modules")):
        checks.assert_same_weights(other, ours)


def test_the_latent_attention_rotates_nothing(loaded):
    """NoPE: a latent-attention block's output does not depend on where the sequence starts."""
    model = loaded["debug"]
    assert model.rope_tables_for("full_attention", torch.arange(4)) is None


def test_flops_formula_within_5_percent_of_counted():
    model = build_model("kimi_linear", "debug", moe_impl="loop")
    measured = measured_flops_per_token(model, 2, 64)
    formula = model.flops_per_token(64)
    print(f"kimi_linear debug T=64: formula/measured = {formula / measured:.4f}")
    assert abs(formula / measured - 1) < 0.05


def test_init_draws_the_kda_decay_and_time_step_as_fla():
    model = build_model("kimi_linear", "debug", seed=3)
    mixer = model.layers["0"].attention
    A, dt = mixer.A_log.exp(), torch.nn.functional.softplus(mixer.dt_bias)
    assert A.min() >= 1.0 and A.max() <= 16.0 and A.std() > 0
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7 and dt.std() > 0
