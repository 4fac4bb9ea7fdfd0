"""Nemotron-H against transformers: the conformance CASE (Mamba-2, attention, MLP and
mixture-of-experts blocks, Nemotron 3 Super's latent experts, float32 and float64; the
published sizes, Nemotron 3 Nano's and Super's included; refusals) and what is Nemotron-H's own: the
chunked Mamba-2 scan against its recurrence, the state reset at document boundaries,
decoding in chunks against the full forward, FLOPs and the planner's activation count.
Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_model, model_args
from forja.models.common.mamba2_scan import chunk_scan, recurrent_scan
from forja.models.nemotron_h import nemotron_h_layer_types
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks
from tests.unit.models.test_flops import measured_flops_per_token
from tests.unit.plan.test_shape_activations import predicted_and_saved

transformers = pytest.importorskip("transformers")

# Bounds on max |logit difference| against transformers 5.25, torch 2.13, CPU, 80 tokens
# (2.5 of the debug flavor's 32-token chunks). float32: measured 3.2e-6 (debug),
# 3.3e-6 (pattern_bias) and 4.1e-6 (latent).
# float64: transformers computes its PyTorch scan (`.float()`, A = -exp(A_log) in float32),
# every RMSNorm (`.to(torch.float32)`) and its router (`.type(torch.float32)`) in float32
# whatever the model's dtype, and returns float32 logits (`.float()`), where forja computes at
# least in float32; in the float64 comparison those run in float64 (tests/unit/models/
# float64_casts.py, the CASE's float64_kept): measured below 7e-15 (1.7e-6 as they were).
TOL = 1e-5

_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048,
              max_position_embeddings=2048, intermediate_size=384, mamba_num_heads=8, mamba_head_dim=32,
              n_groups=2, ssm_state_size=16, chunk_size=32)
_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# The debug flavor's experts: 8 routed of 64 (2 a token), a shared one of 128, weights scaled by 2.5.
_MOE = dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=128, routed_scaling_factor=2.5)


def _make(name: str, config: checks.HFConfig, seed: int):
    """transformers' model (`checks.random_hf_model`) with correction biases of their own: it
    starts them at zero (a buffer, no parameter for `pick`), which would hide a bias put in the
    wrong place or never read."""
    hf = checks.random_hf_model(config.cls, config.config, seed, pick=_pick, draw=_draw)
    with torch.no_grad():
        for key, buffer in hf.named_buffers():
            if key.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return hf


def _pick(key: str, p: torch.Tensor) -> bool:
    # norms, D, dt_bias and the convolutions' biases start at constants: give them values of their own
    return key.endswith(("norm.weight", ".D", "dt_bias", "A_log", "conv1d.bias", "proj.bias"))


def _draw(p: torch.Tensor) -> None:
    p.add_(torch.randn_like(p) * 0.1)


def _logits(case, name, hf, model, tokens, monkeypatch) -> tuple[float, float]:
    flavor = case.configs[name].flavor
    if flavor is not None:  # config.json read into exactly the flavor's args
        assert model.args == model_args("nemotron_h", flavor)
    diff = max_logit_diff(hf, model, tokens)
    hf.config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    _, diff64, _, _, exact = checks.float64_diffs(hf, model, tokens, case)
    print(f"{name}: max |logit diff| float32 {diff:.3e}, float64 {diff64:.3e}")
    assert exact.abs().max() > 1.0  # logits of some size, not a degenerate model
    assert diff < TOL and diff64 < case.float64_tol
    return diff, diff64


CASE = checks.FamilyCase(
    family="nemotron_h",
    configs={
        # The debug flavor: Mamba-2 (8 heads in 2 groups), MLP, attention and mixture-of-experts
        # blocks mixed (`num_local_experts`, the alias, so that the random draws of
        # test_random_configs.py change the expert count; `layers_block_type`, not the alias
        # `layer_types`, which they would shuffle: transformers 5.25's forward fails on its own
        # cache when the first block is an MLP or MoE one, a DummyLayer without get_seq_length).
        # (`moe_latent_size` null, as the flavor: test_random_configs.py draws it.)
        "debug": checks.HFConfig("NemotronHForCausalLM", dict(
            _SHAPE, **_MOE, moe_latent_size=None, layers_block_type=[_KINDS[c] for c in "M-M*-ME"]), "debug"),
        # The older pattern key, biases on the Mamba-2 and MLP projections (and so on the shared
        # experts), one Mamba group, other convolution taps and chunk, tie_word_embeddings (which
        # transformers' Nemotron-H ignores: both matrices are kept), another norm epsilon; experts
        # chosen 3 at a time from the best 2 of 4 groups, their weights neither renormalized nor scaled.
        "pattern_bias": checks.HFConfig("NemotronHForCausalLM", dict(
            _SHAPE, hybrid_override_pattern="MEM*-E*", use_bias=True, mlp_bias=True, n_groups=1, conv_kernel=3,
            chunk_size=16, tie_word_embeddings=True, layer_norm_epsilon=1e-6, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=False, moe_intermediate_size=48,
            moe_shared_expert_intermediate_size=80)),
        # Nemotron 3 Super's latent experts: routed on the full width, computing in 48 between
        # fc1_latent_proj and fc2_latent_proj (biased, with mlp_bias), the shared expert at 128.
        "latent": checks.HFConfig("NemotronHForCausalLM", dict(
            _SHAPE, **_MOE, moe_latent_size=48, mlp_bias=True, layers_block_type=[_KINDS[c] for c in "ME*-ME"])),
    },
    make=_make,
    tol=TOL, logits=_logits, tokens=80,
    float64_kept=("nemotron_h.NemotronHRMSNorm.forward", "nemotron_h.NemotronHRMSNormGated.forward",
                  "nemotron_h.mamba2_scan_forward", "nemotron_h.mamba2_chunk_scan",
                  "nemotron_h.NemotronHTopkRouter.forward", "nemotron_h.NemotronHForCausalLM.forward"),
    greedy={"debug": 20, "pattern_bias": 20, "latent": 12},
    published={"8b": (8_100_852_736,), "nano-9b-v2": (8_888_227_328,),  # equal to transformers' for the config
               "nano-30b-a3b": (31_577_937_344, 3_580_073_408, 3_227_751_872),
               # Nemotron 3 Super: its safetensors headers' BF16 weights less the MTP block's
               # (forja/models/nemotron_h/__init__.py); published 120B / 12B.
               "super-120b-a12b": (120_668_687_360, 12_770_216_960, 12_233_346_048)},
    fused={"debug": ("model.layers.6.mixer.experts.up_proj", "model.layers.6.mixer.experts.down_proj")},
    refusals=(
        ("debug", dict(layers_block_type=["linear_attention", "moe", "attention"]), "layers_block_type='attention'"),
        ("debug", dict(mlp_hidden_act="gelu"), "mlp_hidden_act='gelu'"),
        ("debug", dict(mamba_hidden_act="relu"), "mamba_hidden_act='relu'"),
        ("debug", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ),
    export_refusals=((dict(mtp_depth=1), "with mtp_depth=1 has no equivalent"),
                     (dict(tie_embeddings=True), "with tie_embeddings=True has no equivalent"),
                     (dict(expert_bias=False), "with expert_bias=False has no equivalent"),
                     (dict(score_func="softmax"), "with score_func='softmax' has no equivalent"),
                     (dict(capacity_factor=1.25), "with capacity_factor=1.25 has no equivalent")),
)

checkpoints, loaded = checks.family_fixtures(CASE)


# -- the scan ------------------------------------------------------------------------------------

def _scan_inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, H, P, G, N = 2, 4, 3, 2, 5
    f64 = dict(dtype=torch.float64, generator=g)
    x, dt = torch.randn(b, T, H, P, **f64), torch.rand(b, T, H, **f64)
    A, B, C = -2 * torch.rand(H, **f64), torch.randn(b, T, G, N, **f64), torch.randn(b, T, G, N, **f64)
    return x, dt, A, B, C, torch.randn(b, H, P, N, **f64)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("initial", [False, True])
def test_the_chunked_scan_equals_the_recurrence_in_float64(documents, initial):
    x, dt, A, B, C, S0 = _scan_inputs(37)  # 37 tokens: 4 chunks of 8 and a padded fifth
    docs = torch.tensor([[0] * 8 + [1] * 20 + [2] * 9, [5] * 3 + [6] * 34]) if documents else None
    kw = dict(initial_state=S0 if initial else None, document_ids=docs)
    y1, s1 = recurrent_scan(x, dt, A, B, C, **kw)
    y2, s2 = chunk_scan(x, dt, A, B, C, chunk_size=8, **kw)
    assert (y1 - y2).abs().max() < 1e-10 and (s1 - s2).abs().max() < 1e-10


# The debug flavor computes wholly in float64, its router too (common/moe.py RouterGate scores at
# least in float32): 1e-10 with its mixture of experts and without (its 'E' block an MLP).
DENSE = dict(layer_types=nemotron_h_layer_types("M-M*-M-"), n_experts=0)
FLAVORS = [pytest.param(DENSE, id="dense"), pytest.param({}, id="with-experts")]


@pytest.mark.parametrize("overrides", FLAVORS)
def test_the_state_resets_at_each_document_start(overrides):
    """A packed row's second document gives what it gives alone: the scan, the convolutions
    and attention all start afresh."""
    model = build_model("nemotron_h", "debug", seed=1, **overrides).double()
    a, b = torch.randint(0, 2048, (1, 21)), torch.randint(0, 2048, (1, 43))  # the start mid-chunk
    docs = torch.tensor([[0] * 21 + [1] * 43])
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), docs)
        alone_a, alone_b = model(a), model(b)
    assert (packed[:, :21] - alone_a).abs().max() < 1e-10
    assert (packed[:, 21:] - alone_b).abs().max() < 1e-10


@pytest.mark.parametrize("overrides", FLAVORS)
def test_decoding_in_chunks_equals_the_full_forward(overrides):
    model = build_model("nemotron_h", "debug", seed=2, **overrides).double()
    tokens = torch.randint(0, 2048, (2, 70))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 80)
        parts, start = [], 0
        for n in (5, 1, 33, 1, 1, 29):  # prompt pieces across chunk boundaries, and single tokens
            parts.append(model(tokens[:, start:start + n], cache=cache))
            start += n
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-10


LATENT = dict(moe_latent_dim=48)  # Nemotron 3 Super's latent experts, at the debug flavor's size


@pytest.mark.parametrize("overrides", [{}, LATENT], ids=["debug", "latent"])
def test_flops_formula_within_5_percent_of_counted(overrides):
    model = build_model("nemotron_h", "debug", **overrides)
    ratio = model.flops_per_token(128) / measured_flops_per_token(model, 1, 128)
    print(f"nemotron_h {overrides} T=128: formula/measured = {ratio:.4f}")
    assert abs(ratio - 1) < 0.05


# Measured predicted / saved of the latent experts' block: 1.001 (float32), 1.005 (bf16 autocast).
@pytest.mark.parametrize(("layer", "overrides"), [("0", {}), ("1", {}), ("3", {}), ("6", {}), ("6", LATENT)],
                         ids=["mamba2", "mlp", "attention", "moe", "latent-moe"])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_planner_counts_what_each_kind_of_block_saves(layer, overrides, bf16):
    predicted, actual = predicted_and_saved("nemotron_h", "debug", layer, bf16=bf16, **overrides)
    print(f"nemotron_h block {layer} {overrides} bf16={bf16}: predicted/saved = {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)


def test_latent_experts_compute_in_the_latent_width():
    """The routed experts hold (E, H, L) and (E, L, H) weights, the router and shared expert
    read the full width, and the latent projections count as always active."""
    dense, latent = build_model("nemotron_h", "debug", device="meta"), build_model("nemotron_h", "debug",
                                                                                  device="meta", **LATENT)
    ff = latent.layers["6"].feed_forward
    assert ff.experts.w1.shape == (8, 64, 48) and ff.experts.w2.shape == (8, 48, 64)
    assert ff.router.gate.weight.shape == (8, 128) and ff.shared_experts.w1.weight.shape == (128, 128)
    assert ff.to_latent.weight.shape == (48, 128) and ff.from_latent.weight.shape == (128, 48)
    projections = 2 * 48 * 128
    routed_saved = 2 * 8 * 64 * (128 - 48)
    assert dense.num_params() - latent.num_params() == routed_saved - projections
    assert dense.num_active_params() - latent.num_active_params() == routed_saved * 2 // 8 - projections  # top 2 of 8
    assert latent.layers["6"].structure.expert_width == 48 and dense.layers["6"].structure.expert_width == 0
