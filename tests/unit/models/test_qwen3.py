"""Qwen3 and Qwen3-MoE against transformers: same weights, same logits, both ways; the
experts' per-expert and fused checkpoint layouts; greedy decoding; published sizes;
refusals of what forja cannot represent; gradients under tensor parallelism."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.generate import SamplingConfig, generate
from forja.models import build_model, load_hf_checkpoint, model_args, save_hf_checkpoint
from forja.models.qwen3.hf import config_from_args
from forja.testing import run_distributed
from tests.helpers import hf_greedy, max_logit_diff, save_hf_models

transformers = pytest.importorskip("transformers")

# Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
# Measured: 0.0 for "dense" and "moe" (the same ops in the same order, experts included),
# 2.4e-6 for "moe_step2": transformers runs an expert's gate and up projections as one
# (2H, D) matmul, forja as two (H, D) ones, and BLAS rounds the two shapes differently
# (1-2e-7 on an expert's output when H = 48; identical when H = 64).
TOL = 1e-5

_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6,
              rope_theta=1_000_000.0)
# name -> (transformers class, config kwargs, the forja flavor it equals or None).
CONFIGS = {
    # The `debug` flavor: head_dim 64 != 128 / 4 heads, GQA 2:1, tied embeddings.
    "dense": ("Qwen3ForCausalLM", dict(_SHAPE, head_dim=64, tie_word_embeddings=True), "debug"),
    # The `debug-moe` flavor: 8 experts, top 2, renormalized; layer 0 dense (mlp_only_layers).
    "moe": ("Qwen3MoeForCausalLM", dict(_SHAPE, head_dim=32, tie_word_embeddings=False, num_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                        mlp_only_layers=[0]), "debug-moe"),
    # Every other block sparse, top 3 not renormalized, another eps and theta.
    "moe_step2": ("Qwen3MoeForCausalLM", dict(
        _SHAPE, head_dim=32, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2, rms_norm_eps=1e-5,
        rope_theta=10_000.0), None),
}


def make_hf_model(name: str, seed: int = 0):
    cls_name, kwargs, _ = CONFIGS[name]
    cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    # A wider init than the default makes logits and router scores peaked: no near-ties.
    return cls(cls.config_class(initializer_range=0.1, **kwargs)).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory saved by transformers, the transformers model)."""
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
        assert model.args == model_args("qwen3", flavor)
    diff = max_logit_diff(hf, model, _tokens(48))
    print(f"{name}: max |logit diff| = {diff:.3e}")
    assert diff < TOL


def test_transformers_saves_one_tensor_per_expert(checkpoints):
    names = _stored_names(checkpoints["moe"][0])
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("name", ["moe", "moe_step2"])
def test_fused_expert_layout_loads_the_same(checkpoints, tmp_path, name):
    path, hf = checkpoints[name]
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)  # transformers 5's own layout
    names = _stored_names(tmp_path / "fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.experts.down_proj" in names
    fused, per_expert = load_hf_checkpoint(tmp_path / "fused"), load_hf_checkpoint(path)
    for (key, a), (_, b) in zip(fused.state_dict().items(), per_expert.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_round_trips_bit_exact_and_transformers_reads_it(checkpoints, tmp_path, name):
    path, _ = checkpoints[name]
    model = load_hf_checkpoint(path)
    out = save_hf_checkpoint(model, tmp_path / "export")
    assert _stored_names(out) == _stored_names(path)  # the released (per-expert) layout
    back = load_hf_checkpoint(out)
    for (key, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == CONFIGS[name][0]
    assert max_logit_diff(reloaded, model, _tokens(33)) < TOL


@pytest.mark.parametrize("flavor", ["debug", "debug-moe"])
def test_forja_model_exports_to_transformers(tmp_path, flavor):
    model = build_model("qwen3", flavor, seed=3)
    save_hf_checkpoint(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert max_logit_diff(hf, model, _tokens(20)) < TOL


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_decoding_equals_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    model = load_hf_checkpoint(path)
    prompt = _tokens(9, seed=4)
    ref = hf_greedy(hf, prompt, 24)
    assert torch.equal(generate(model, prompt, SamplingConfig(max_new_tokens=24)), ref)


# -- published sizes -------------------------------------------------------------------------

# (total, active per token), tied weights once; equal to transformers' count for the same
# config.json (built on the meta device below) and to the released models' reported sizes.
PUBLISHED = {
    "0.6b": (596_049_920, 596_049_920),
    "1.7b": (1_720_574_976, 1_720_574_976),
    "4b": (4_022_468_096, 4_022_468_096),
    "8b": (8_190_735_360, 8_190_735_360),
    "14b": (14_768_307_200, 14_768_307_200),
    "32b": (32_762_123_264, 32_762_123_264),
    "30b-a3b": (30_532_122_624, 3_353_032_704),
    "235b-a22b": (235_093_634_560, 22_190_763_520),
}


def _hf_meta_params(model) -> int:
    cfg = dict(config_from_args(model.args))
    cls = getattr(transformers, cfg.pop("architectures")[0])
    cfg.pop("model_type")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cls.config_class(**cfg))
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts_equal_transformers(flavor):
    model = build_model("qwen3", flavor, device="meta")
    assert (model.num_params(), model.num_active_params()) == PUBLISHED[flavor]
    assert model.num_params() == _hf_meta_params(model)


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

def _copy(path, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def _edit_config(dst, **changes):
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("name", "changes", "message"), [
    ("dense", dict(attention_bias=True), r"attention_bias=True is not supported"),
    ("dense", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ("dense", dict(use_sliding_window=True, sliding_window=64), r"use_sliding_window=True is not supported"),
    ("dense", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                    "original_max_position_embeddings": 512}),
     r"rope_parameters\.rope_type='yarn' is not supported"),
    ("dense", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type='dynamic'"),
    ("moe", dict(shared_expert_intermediate_size=256), r"shared_expert_intermediate_size=256 is not supported"),
    ("moe", dict(scoring_func="sigmoid"), r"scoring_func='sigmoid' is not supported"),
])
def test_unsupported_config_option_is_named(checkpoints, tmp_path, name, changes, message):
    dst = _copy(checkpoints[name][0], tmp_path)
    _edit_config(dst, **changes)
    with pytest.raises(ForjaError, match=r"config\.json: " + message):
        load_hf_checkpoint(dst)


def _edit_weights(dst, edit):
    file = dst / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_expert_is_named(checkpoints, tmp_path):
    dst = _copy(checkpoints["moe"][0], tmp_path)
    _edit_weights(dst, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight is missing"):
        load_hf_checkpoint(dst)


def test_misshapen_expert_and_extra_expert_are_named(checkpoints, tmp_path):
    dst = _copy(checkpoints["moe"][0], tmp_path)
    _edit_weights(dst, lambda t: t.update({"model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(128, 63)}))
    with pytest.raises(ForjaError, match=r"experts\.0\.down_proj\.weight has shape \[128, 63\]; .* expects \[128, 64"):
        load_hf_checkpoint(dst)
    dst = _copy(checkpoints["moe"][0], tmp_path / "extra")
    _edit_weights(dst, lambda t: t.update({"model.layers.1.mlp.experts.8.gate_proj.weight": torch.zeros(64, 128)}))
    with pytest.raises(ForjaError, match=r"unexpected tensor model\.layers\.1\.mlp\.experts\.8\.gate_proj\.weight"):
        load_hf_checkpoint(dst)


def test_damaged_fused_checkpoint_is_reported_in_its_own_layout(checkpoints, tmp_path):
    _, hf = checkpoints["moe"]
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    _edit_weights(tmp_path / "fused", lambda t: t.pop("model.layers.3.mlp.experts.down_proj"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.3\.mlp\.experts\.down_proj is missing"):
        load_hf_checkpoint(tmp_path / "fused")


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(qk_norm=False), "qk_norm"), (dict(sliding_window=64), "sliding_window"),
    (dict(score_func="sigmoid"), "score_func"), (dict(n_shared_experts=1), "n_shared_experts"),
])
def test_export_refuses_what_transformers_cannot_express(tmp_path, overrides, field):
    model = build_model("qwen3", "debug-moe", device="meta", **overrides)
    with pytest.raises(ForjaError, match=f"a Qwen3 with {field}="):
        save_hf_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# -- tensor parallelism ----------------------------------------------------------------------

_GRADS = ("layers.0.attention.q_norm.weight", "layers.3.attention.k_norm.weight", "layers.1.attention.wk.weight")


def _loss_and_grads(model, tp: int):
    from forja.parallel.tp import loss_context

    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 2048, (2, 32), generator=gen) for _ in range(2))
    with loss_context(tp):
        loss = model(tokens, labels=labels)
        loss.backward()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    grads = dict(model.named_parameters())
    return float(full(loss.detach())), {n: full(grads[n].grad) for n in _GRADS}


def _tp_run(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    from forja.models.qwen3.parallelize import qwen3_tp_plan
    from forja.parallel.tp import apply_tp

    mesh, out = init_device_mesh("cpu", (world,)), {}
    for flavor in _TP_FLAVORS:
        for sequence_parallel in (False, True):
            model = build_model("qwen3", flavor, seed=0)
            apply_tp(model, mesh, qwen3_tp_plan(model.args, sequence_parallel))
            out[flavor, sequence_parallel] = _loss_and_grads(model, world)
    return out


_TP_FLAVORS = ("debug", "debug-moe")


@pytest.mark.slow  # two spawned ranks: ~10 s on an idle 2-core machine
def test_tensor_parallel_qk_norm_gradients_are_summed_over_heads():
    """q_norm/k_norm see only a rank's heads; their weight gradients must still be the whole
    model's (left as plain replicated tensors they would differ by ~2e-3 here)."""
    reference = {flavor: _loss_and_grads(build_model("qwen3", flavor, seed=0), tp=1) for flavor in _TP_FLAVORS}
    for rank_results in run_distributed(_tp_run, 2):
        for (flavor, _), (tp_loss, tp_grads) in rank_results.items():
            loss, grads = reference[flavor]
            assert abs(tp_loss - loss) < 1e-6, flavor
            for name in _GRADS:
                assert torch.allclose(tp_grads[name], grads[name], atol=1e-7, rtol=1e-5), (flavor, name)
