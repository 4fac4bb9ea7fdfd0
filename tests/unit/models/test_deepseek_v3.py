"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM on random weights: logits, checkpoints
both ways, greedy decoding, published sizes, refused configs. Tensor parallelism:
test_tp_families.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from forja.errors import ForjaError
from forja.generate import SamplingConfig, generate
from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from forja.models.deepseek_v3.hf import ADAPTER
from tests.helpers import hf_greedy, max_logit_diff, save_hf_models
from tests.unit.models.family_checks import assert_same_weights, edited_checkpoint, random_tokens

transformers = pytest.importorskip("transformers")

# Bound on max |logit difference| in float32, a few times what is measured (transformers 5.24,
# torch 2.13, CPU; logits of magnitude ~3): 1.1e-6 at most. Attention is bit-equal
# (test_mla.py); the rest is the order in which experts' outputs are summed.
DS_TOL = 5e-6

_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8}
_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, max_position_embeddings=256)
HF_CONFIGS = {
    # A query latent; YaRN with unequal mscales (original context 32 < the tests' 48 tokens);
    # 4 expert groups of 2, 2 chosen; renormalized, scaled weights; another norm eps.
    "lora_yarn_groups": dict(_SHAPE, q_lora_rank=24, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                             n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                             norm_topk_prob=True, rms_norm_eps=1e-5, rope_parameters=_YARN),
    # Queries projected directly (V2-Lite style), plain RoPE, no groups, weights not
    # renormalized, two dense blocks, tied embeddings.
    "direct_tied": dict(_SHAPE, q_lora_rank=None, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=1, topk_group=1, first_k_dense_replace=2, routed_scaling_factor=1.0,
                        norm_topk_prob=False, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0}),
}


def make_hf_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    # A wide init makes logits peaked (greedy choices far from ties) and routing decisive.
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(initializer_range=0.1,
                                                                             **HF_CONFIGS[name])).eval()
    with torch.no_grad():  # a trained-looking balancing bias, so that it matters
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def ds_checkpoints(tmp_path_factory):
    """name -> (saved directory, the transformers model)."""
    return save_hf_models(tmp_path_factory, make_hf_model, HF_CONFIGS)


def _tokens(n: int = 48, seed: int = 1) -> torch.Tensor:
    return random_tokens(n, seed, vocab_size=300)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_load_matches_transformers_logits(ds_checkpoints, name):
    path, hf = ds_checkpoints[name]
    model = load_hf_checkpoint(path)
    diff = max_logit_diff(hf, model, _tokens())
    print(f"{name}: max |logit diff| = {diff:.3e}")
    assert diff < DS_TOL


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_save_is_the_loaded_checkpoint_exactly_and_transformers_reads_it(ds_checkpoints, tmp_path, name):
    path, hf = ds_checkpoints[name]
    out = save_hf_checkpoint(load_hf_checkpoint(path), tmp_path / "export")
    original, saved = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(original)  # rope rows permuted back, experts cut per expert
    for key, value in original.items():
        assert torch.equal(saved[key], value), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert max_logit_diff(reloaded, load_hf_checkpoint(out), _tokens()) < DS_TOL
    assert torch.equal(reloaded(_tokens()).logits, hf(_tokens()).logits)


def test_debug_flavor_exports_and_reimports(tmp_path):
    model = build_model("deepseek_v3", "debug", seed=3)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            assert torch.equal(buf, torch.zeros_like(buf)), name  # the balancing bias starts at zero
            buf.normal_(0.0, 0.05)
    save_hf_checkpoint(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    tokens = torch.randint(0, 2048, (2, 80))  # past the debug flavor's original context of 64
    diff = max_logit_diff(hf, model, tokens)
    print(f"debug flavor: max |logit diff| = {diff:.3e}")
    assert diff < DS_TOL
    assert_same_weights(model, load_hf_checkpoint(tmp_path / "a"))


def test_transformers_fused_expert_layout_loads(ds_checkpoints, tmp_path):
    _, hf = ds_checkpoints["lora_yarn_groups"]
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    assert max_logit_diff(hf, load_hf_checkpoint(tmp_path), _tokens()) < DS_TOL


def test_deepseeks_own_config_dialect_and_mtp_tensors(ds_checkpoints, tmp_path):
    """The published config.json (4.x keys, DeepSeek's routing keys, an MTP layer) loads,
    and the MTP layer's tensors are skipped."""
    path, hf = ds_checkpoints["lora_yarn_groups"]
    yarn = {k: v for k, v in _YARN.items() if k not in ("rope_type", "rope_theta")}
    mtp = {"model.layers.61.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.61.self_attn.q_a_proj.weight": torch.zeros(24, 64),
           "model.layers.3.enorm.weight": torch.zeros(64)}
    dst = edited_checkpoint(path, tmp_path / "ckpt", drop=("rope_parameters", "rope_interleave"),
                            edit_tensors=lambda t: t.update(mtp), rope_theta=10_000.0,
                            rope_scaling={"type": "yarn", **yarn}, topk_method="noaux_tc", scoring_func="sigmoid",
                            moe_layer_freq=1, num_nextn_predict_layers=1, aux_loss_alpha=0.001, seq_aux=True)
    assert max_logit_diff(hf, load_hf_checkpoint(dst), _tokens()) < DS_TOL


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_greedy_32_tokens_equals_transformers_generate(ds_checkpoints, name):
    path, hf = ds_checkpoints[name]
    model = load_hf_checkpoint(path)
    prompt = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(4))
    ref = hf_greedy(hf, prompt, 32)
    cached = generate(model, prompt, SamplingConfig(max_new_tokens=32))
    uncached = generate(model, prompt, SamplingConfig(max_new_tokens=32), use_cache=False)
    assert cached.shape == (2, 41)
    assert torch.equal(cached, ref)
    assert torch.equal(cached, uncached)


# -- published sizes -------------------------------------------------------------------------

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
# (total, active per token) of forja's model (V3: without the multi-token prediction module).
COUNTS = {"16b": (15_706_484_224, 2_661_150_208), "236b": (235_741_434_880, 21_375_800_320),
          "671b": (671_026_404_352, 37_552_282_624)}


@pytest.mark.parametrize("flavor", list(RELEASED))
def test_published_parameter_counts_equal_transformers(flavor):
    model = build_model("deepseek_v3", flavor, device="meta")
    config = transformers.DeepseekV3Config(num_key_value_heads=RELEASED[flavor]["num_attention_heads"],
                                           **RELEASED[flavor])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert model.num_params() == sum(p.numel() for p in hf.parameters()) == COUNTS[flavor][0]
    assert model.num_active_params() == COUNTS[flavor][1]


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

@pytest.mark.parametrize(("changes", "match"), [
    ({"topk_method": "group_limited_greedy"}, r"topk_method='group_limited_greedy' is not supported"),
    ({"topk_method": "greedy"}, r"topk_method='greedy' is not supported"),  # with n_group = 4
    ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope type='longrope' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"rope_interleave": False}, r"rope_interleave=False is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config\.quant_method='fp8' is not supported; convert"),
])
def test_unsupported_config_field_is_named(ds_checkpoints, tmp_path, changes, match):
    dst = edited_checkpoint(ds_checkpoints["lora_yarn_groups"][0], tmp_path / "ckpt", **changes)
    with pytest.raises(ForjaError, match=r"^config\.json: " + match) as err:
        load_hf_checkpoint(dst)
    assert "\n" not in str(err.value)


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
