"""Qwen3.5 and Qwen3.5-MoE against transformers: the hybrid of Gated DeltaNet and gated
attention with the same weights gives the same logits, both ways; packed documents; the
multimodal checkpoint's text model; greedy decoding through the cache; published sizes;
refusals of what forja cannot represent."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.generate import SamplingConfig, generate
from forja.models import build_model, load_hf_checkpoint, model_args, save_hf_checkpoint
from forja.models.qwen3_5.hf import config_from_args
from tests.helpers import hf_greedy, max_logit_diff, save_hf_models

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
    cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    model = cls(cls.config_class(initializer_range=0.1, **kwargs)).eval()
    with torch.no_grad():  # zero-centered norms start at 0 (scale 1): give them values of their own
        for key, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_hf_models(tmp_path_factory, make_hf_model, CONFIGS)


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, _SHAPE["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed))


def _stored_names(path) -> set[str]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_matches_transformers_logits(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_hf_checkpoint(path)
    flavor = CONFIGS[name][2]
    if flavor is not None:  # config.json read into exactly the flavor's args
        assert model.args == model_args("qwen3_5", flavor)
    tokens = _tokens(80)  # more than one 64-token chunk of the delta rule
    diff = max_logit_diff(hf, model, tokens)
    hf.config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    hf64, model64 = copy.deepcopy(hf).double(), copy.deepcopy(model).double()
    with torch.no_grad():
        exact = hf64(tokens).logits
        hf_rounding = (hf(tokens).logits.double() - exact).abs().max().item()
        diff64 = (model64(tokens) - exact).abs().max().item()
    print(f"{name}: max |logit diff| float32 {diff:.3e} (transformers' own float32 error {hf_rounding:.3e}), "
          f"float64 {diff64:.3e}")
    assert diff < hf_rounding
    if "moe" not in name:
        assert diff < TOL and diff64 < TOL_FLOAT64


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_round_trips_bit_exact_and_transformers_reads_it(checkpoints, tmp_path, name):
    path, _ = checkpoints[name]
    model = load_hf_checkpoint(path)
    out = save_hf_checkpoint(model, tmp_path / "export")
    back = load_hf_checkpoint(out)
    for (key, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == CONFIGS[name][0]
    assert max_logit_diff(reloaded, model, _tokens(33)) < TOL


def test_fused_expert_layout_loads_the_same(checkpoints, tmp_path):
    path, hf = checkpoints["moe"]
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)  # transformers 5's own layout
    assert "model.layers.1.mlp.experts.gate_up_proj" in _stored_names(tmp_path / "fused")
    fused, saved = load_hf_checkpoint(tmp_path / "fused"), load_hf_checkpoint(path)
    for (key, a), (_, b) in zip(fused.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


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
def test_greedy_decoding_equals_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_hf_checkpoint(path)
    prompt = _tokens(9, seed=4)
    ref = hf_greedy(hf, prompt, 20)
    assert torch.equal(generate(model, prompt, SamplingConfig(max_new_tokens=20)), ref)


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


def _hf_meta_params(model) -> int:
    cfg = dict(config_from_args(model.args))
    cls = getattr(transformers, cfg.pop("architectures")[0])
    cfg.pop("model_type")
    with torch.device("meta"):
        hf = cls(cls.config_class(**cfg))
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts_equal_transformers(flavor):
    model = build_model("qwen3_5", flavor, device="meta")
    total, active = model.num_params(), model.num_active_params()
    print(f"{flavor}: {total:,} total, {active:,} active")
    assert total == _hf_meta_params(model)
    assert (total, active) == PUBLISHED[flavor]


# -- what forja cannot represent ---------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    (dict(attention_bias=True), "attention_bias=True is not supported by forja's Qwen3.5"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types='sliding_attention'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}), "rope_type='yarn'"),
])
def test_unsupported_config_option_is_named(checkpoints, tmp_path, changes, message):
    path, _ = checkpoints["dense"]
    config = {**json.loads((path / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ForjaError, match=message):
        load_hf_checkpoint(tmp_path)


def test_export_refuses_what_transformers_cannot_express(tmp_path):
    with pytest.raises(ForjaError, match="with attention_sinks=True has no equivalent in transformers"):
        save_hf_checkpoint(build_model("qwen3_5", "debug", attention_sinks=True), tmp_path)


# -- tensor parallelism ----------------------------------------------------------------------

# Every kind of Gated DeltaNet parameter (projections, convolutions, decay, the shared norm)
# and the gated attention's gate: a misplaced shard shows in one of them.
_GRADS = ("layers.0.attention.wq.weight", "layers.0.attention.conv_k.weight", "layers.1.attention.conv_v.weight",
          "layers.0.attention.A_log", "layers.2.attention.dt_bias", "layers.1.attention.norm.weight",
          "layers.2.attention.wb.weight", "layers.1.attention.wa.weight", "layers.2.attention.wo.weight",
          "layers.3.attention.wg.weight", "layers.3.attention.q_norm.weight", "layers.0.feed_forward.w2.weight")


def _tp_model():
    model = build_model("qwen3_5", "debug", seed=0)
    with torch.no_grad():  # per-head values that differ by head, and norms away from their init
        for block in model.layers.values():
            for name, p in block.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.linspace(-0.5, 0.5, p.numel()))
    return model


def _loss_and_grads(model, tp: int):
    from forja.parallel.tp import loss_context

    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 2048, (2, 32), generator=gen) for _ in range(2))
    docs = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])
    with loss_context(tp):
        loss = model(tokens, docs, labels=labels)
        loss.backward()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    grads = dict(model.named_parameters())
    return float(full(loss.detach())), {n: full(grads[n].grad) for n in _GRADS}


def _tp_run(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from forja.models.qwen3_5.parallelize import qwen3_5_tp_plan
    from forja.parallel.tp import apply_tp

    mesh, out = init_device_mesh("cpu", (world,)), {}
    for sequence_parallel in (False, True):
        model = _tp_model()
        apply_tp(model, mesh, qwen3_5_tp_plan(model.args, sequence_parallel))
        assert model.layers["0"].attention.A_log.to_local().shape == (2,)  # half the value heads
        assert model.layers["0"].attention.conv_q.weight.to_local().shape == (32, 1, 4)  # one key head's channels
        out[sequence_parallel] = _loss_and_grads(model, world)
    return out


@pytest.mark.slow  # two spawned ranks
def test_tensor_parallel_loss_and_gradients_equal_one_device():
    """Gated DeltaNet split by head over 2 ranks (one key head and two value heads each),
    with and without sequence parallelism, on a packed batch."""
    from forja.testing import run_distributed

    loss, grads = _loss_and_grads(_tp_model(), tp=1)
    ranks = run_distributed(_tp_run, 2)
    for sequence_parallel in (False, True):
        for name in _GRADS:
            got = ranks[0][sequence_parallel][1][name]
            err = (got - grads[name]).abs().max().item()
            assert torch.allclose(got, grads[name], atol=1e-6, rtol=1e-5), (sequence_parallel, name, err)
        for r in ranks:
            assert abs(r[sequence_parallel][0] - loss) < 1e-5, (sequence_parallel, r[sequence_parallel][0], loss)


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_the_mtp_module_saves_under_the_published_names_and_loads_back(tmp_path, flavor):
    """The published checkpoints carry one MTP module (`mtp.*`, which transformers skips)."""
    model = build_model("qwen3_5", flavor, seed=4, mtp_depth=1)
    out = save_hf_checkpoint(model, tmp_path / "export")
    names = _stored_names(out)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.input_layernorm.weight"} <= names
    assert ("mtp.layers.0.mlp.shared_expert_gate.weight" in names) == (flavor == "debug-moe")
    back = load_hf_checkpoint(out)
    assert back.args.mtp_depth == 1
    for (key, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # the main model; mtp.* skipped
    assert max_logit_diff(reloaded, model, _tokens(20)) < 1e-4  # within transformers' own float32 rounding (above)
    fresh = build_model("qwen3_5", flavor, seed=4, mtp_depth=1).mtp.layers["4"]
    assert not fresh.hnorm.weight.any() and not fresh.norm.weight.any()  # zero-centered: zeros, a scale of one


def test_a_config_counting_an_mtp_module_transformers_did_not_save(checkpoints, tmp_path):
    path, hf = checkpoints["dense"]
    config = {**json.loads((path / "config.json").read_text()), "mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    model = load_hf_checkpoint(tmp_path)
    assert model.mtp is None and model.args.mtp_depth == 0  # the main model, as transformers loads it
