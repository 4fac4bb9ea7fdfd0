"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM on random weights: the conformance
CASE (logits, checkpoints written back tensor for tensor, greedy decoding, published sizes,
refused configs) and what is DeepSeek-V3's own: its config dialect and MTP tensors, routing
transformers cannot compute, its fields, fused ops, FLOPs. Tensor parallelism:
test_tp_families.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint
from forja.models.deepseek_v3.hf import ADAPTER
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8}
_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, max_position_embeddings=256)
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# The shapes of the released config.json files (routing keys aside: they change no shape).
RELEASED = {
    "16b": dict(vocab_size=102_400, hidden_size=2048, intermediate_size=10_944, moe_intermediate_size=1408,
                num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2, n_routed_experts=64,
                num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None, n_group=1, topk_group=1, **_MLA),
    "236b": dict(vocab_size=102_400, hidden_size=5120, intermediate_size=12_288, moe_intermediate_size=1536,
                 num_hidden_layers=60, num_attention_heads=128, n_shared_experts=2, n_routed_experts=160,
                 num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=1536, n_group=8, topk_group=3, **_MLA),
    "671b": dict(vocab_size=129_280, hidden_size=7168, intermediate_size=18_432, moe_intermediate_size=2048,
                 num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                 num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, n_group=8, topk_group=4, **_MLA),
}


def _released_config(flavor: str) -> dict:
    """The released shape as transformers' DeepseekV3Config takes it (V2's routing is not its own)."""
    heads = RELEASED[flavor]["num_attention_heads"]
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_key_value_heads": heads,
            **RELEASED[flavor]}


def _make(name: str, config: checks.HFConfig, seed: int):
    torch.manual_seed(seed)
    # A wide init makes logits peaked (greedy choices far from ties) and routing decisive.
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(initializer_range=0.1,
                                                                             **config.config)).eval()
    with torch.no_grad():  # a trained-looking balancing bias, so that it matters
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model


@torch.no_grad()
def _balancing_bias(model) -> None:
    for name, buf in model.named_buffers():
        assert torch.equal(buf, torch.zeros_like(buf)), name  # the balancing bias starts at zero
        buf.normal_(0.0, 0.05)


def _the_same_logits_as_the_original(name, model, reloaded, checkpoints) -> None:
    tokens = checks.random_tokens(48, vocab_size=300)
    assert torch.equal(reloaded(tokens).logits, checkpoints[name][1](tokens).logits)


CASE = checks.FamilyCase(
    family="deepseek_v3",
    configs={
        # A query latent; YaRN with unequal mscales (original context 32 < the tests' 48 tokens);
        # 4 expert groups of 2, 2 chosen; renormalized, scaled weights; another norm eps.
        "lora_yarn_groups": checks.HFConfig("DeepseekV3ForCausalLM", dict(
            _SHAPE, q_lora_rank=24, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
            topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5,
            rope_parameters=_YARN)),
        # Queries projected directly (V2-Lite style), plain RoPE, no groups, weights not
        # renormalized, two dense blocks, tied embeddings.
        "direct_tied": checks.HFConfig("DeepseekV3ForCausalLM", dict(
            _SHAPE, q_lora_rank=None, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=2, routed_scaling_factor=1.0, norm_topk_prob=False,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50_000.0})),
    },
    make=_make,
    # Bound on max |logit difference| in float32, a few times what is measured (transformers 5.24,
    # torch 2.13, CPU; logits of magnitude ~3): 1.1e-6 at most. Attention is bit-equal
    # (test_mla.py); the rest is the order in which experts' outputs are summed.
    tol=5e-6,
    # float64: transformers' RMSNorm and router in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("deepseek_v3.DeepseekV3RMSNorm.forward", "deepseek_v3.DeepseekV3TopkRouter.forward"),
    same_tensors=True,  # rope rows permuted back, experts cut per expert
    after_round_trip=_the_same_logits_as_the_original,
    greedy={"lora_yarn_groups": 32, "direct_tied": 32}, uncached=True,
    prepare_export=_balancing_bias, export_tokens=80,  # past the debug flavor's original context of 64
    # (total, active per token) of forja's model (V3: without the multi-token prediction module).
    published={"16b": (15_706_484_224, 2_661_150_208), "236b": (235_741_434_880, 21_375_800_320),
               "671b": (671_026_404_352, 37_552_282_624)},
    hf_config=_released_config,
    fused={"lora_yarn_groups": ("model.layers.1.mlp.experts.gate_up_proj",)},
    refusals=(
        ("lora_yarn_groups", {"topk_method": "group_limited_greedy"},
         r"topk_method='group_limited_greedy' is not supported"),
        ("lora_yarn_groups", {"topk_method": "greedy"}, r"topk_method='greedy' is not supported"),  # n_group = 4
        ("lora_yarn_groups", {"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
        ("lora_yarn_groups", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
         r"rope type='longrope' is not supported"),
        ("lora_yarn_groups", {"attention_bias": True}, r"attention_bias=True is not supported"),
        ("lora_yarn_groups", {"rope_interleave": False}, r"rope_interleave=False is not supported"),
        ("lora_yarn_groups", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ("lora_yarn_groups", {"quantization_config": {"quant_method": "fp8"}},
         r"quantization_config\.quant_method='fp8' is not supported; convert"),
    ),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def _tokens(n: int = 48, seed: int = 1) -> torch.Tensor:
    return checks.random_tokens(n, seed, vocab_size=300)


def test_deepseeks_own_config_dialect_and_mtp_tensors(checkpoints, tmp_path):
    """The published config.json (4.x keys, DeepSeek's routing keys, an MTP layer) loads,
    and the MTP layer's tensors are skipped."""
    path, hf = checkpoints["lora_yarn_groups"]
    yarn = {k: v for k, v in _YARN.items() if k not in ("rope_type", "rope_theta")}
    mtp = {"model.layers.61.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.61.self_attn.q_a_proj.weight": torch.zeros(24, 64),
           "model.layers.3.enorm.weight": torch.zeros(64)}
    dst = checks.edited_checkpoint(path, tmp_path / "ckpt", drop=("rope_parameters", "rope_interleave"),
                            edit_tensors=lambda t: t.update(mtp), rope_theta=10_000.0,
                            rope_scaling={"type": "yarn", **yarn}, topk_method="noaux_tc", scoring_func="sigmoid",
                            moe_layer_freq=1, num_nextn_predict_layers=1, aux_loss_alpha=0.001, seq_aux=True)
    assert max_logit_diff(hf, load_hf_checkpoint(dst), _tokens()) < CASE.tol


# -- its fields, ops and FLOPs ------------------------------------------------------------------

def test_debug_flavor_size_and_layers():
    model = build_model("deepseek_v3", "debug", device="meta")
    assert 1.5e6 < model.num_params() < 2.5e6
    assert type(model.layers["0"].feed_forward).__name__ == "SwiGLU"
    assert all(type(model.layers[i].feed_forward).__name__ == "MoE" for i in "123")
    assert model.layers["0"].attention.q_lora and model.layers["0"].attention.wkv_b.weight.shape == (4 * 64, 32)


@torch.no_grad()
def test_fused_ops_compute_the_same_model():
    # On CPU the fused ops run their references: this checks the wiring (the Triton kernels
    # are checked against the references in tests/unit/ops).
    plain = build_model("deepseek_v3", "debug", seed=0)
    fused = build_model("deepseek_v3", "debug", seed=0, fused_ops=("rms_norm", "rope", "swiglu"))
    tokens = torch.randint(0, 2048, (2, 24))
    assert torch.equal(plain(tokens), fused(tokens))


def test_flops_count_latent_attention_widths():
    model = build_model("deepseek_v3", "debug", device="meta")
    a = model.args
    attention = 6 * a.n_layers * a.n_heads * (48 + 32) * 100  # q.k over 32 + 16, values 32 wide
    assert model.flops_per_token(100) == 6 * model.num_active_params(exclude_embeddings=True) + attention


# -- refused configs -------------------------------------------------------------------------

def test_export_refuses_routing_transformers_cannot_compute(tmp_path):
    v2 = build_model("deepseek_v3", "16b", device="meta").args
    with pytest.raises(ForjaError, match="score_func='softmax' has no DeepseekV3ForCausalLM equivalent"):
        ADAPTER.config_from_args(v2)
    grouped = dataclasses.replace(build_model("deepseek_v3", "debug", device="meta").args, group_score="max")
    with pytest.raises(ForjaError, match="group_score='max'"):
        ADAPTER.config_from_args(grouped)


def test_bad_model_fields_are_named():
    with pytest.raises(ForjaError, match="model.n_kv_heads=2: latent attention"):
        build_model("deepseek_v3", "debug", device="meta", n_kv_heads=2)
    with pytest.raises(ForjaError, match="model.qk_rope_head_dim=15 must be even"):
        build_model("deepseek_v3", "debug", device="meta", qk_rope_head_dim=15)
    with pytest.raises(ForjaError, match="topk_groups"):
        build_model("deepseek_v3", "debug", device="meta", topk_groups=3)
