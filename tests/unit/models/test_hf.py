"""Hugging Face interop: same weights give the same logits, both ways, and bad
checkpoints stop with one error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from tests.helpers import max_logit_diff

from .conftest import HF_CONFIGS

transformers = pytest.importorskip("transformers")

# Bounds on max |logit difference| in float32, a few times what is measured (transformers
# 5.24, torch 2.13, CPU): Llama 0.0 (the same ops in the same order as transformers), GPT-2
# 1.4e-6 at most (its q/k/v come out of one fused projection there, three here).
LLAMA_TOL = 1e-6
GPT2_TOL = 5e-6


def tol(name: str) -> float:
    return GPT2_TOL if "gpt2" in name else LLAMA_TOL


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_load_matches_transformers_logits(hf_checkpoints, name):
    path, hf = hf_checkpoints[name]
    model = load_hf_checkpoint(path)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    diff = max_logit_diff(hf, model, tokens)
    print(f"{name}: max |logit diff| = {diff:.3e}")
    assert diff < tol(name)


def _to_4x_dialect(cfg: dict) -> dict:
    """Rewrite a transformers 5.x config (rope_parameters) the way 4.x wrote it."""
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params if params.get("rope_type") != "default" else None
    return cfg


@pytest.mark.parametrize("name", ["llama_gqa_scaled_tied", "llama_untied_theta"])
def test_reads_transformers_4x_config_dialect(hf_checkpoints, tmp_path, name):
    path, hf = hf_checkpoints[name]
    old = tmp_path / "old"
    shutil.copytree(path, old)
    cfg = json.loads((old / "config.json").read_text())
    assert "rope_parameters" in cfg  # what transformers 5 writes
    (old / "config.json").write_text(json.dumps(_to_4x_dialect(cfg)))
    tokens = torch.randint(0, hf.config.vocab_size, (1, 40))
    assert max_logit_diff(hf, load_hf_checkpoint(old), tokens) < tol(name)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_save_then_transformers_loads_same_logits(hf_checkpoints, tmp_path, name):
    path, _ = hf_checkpoints[name]
    model = load_hf_checkpoint(path)
    out = save_hf_checkpoint(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    assert max_logit_diff(reloaded, model, tokens) < tol(name)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_forja_model_exports_and_reimports(tmp_path, family):
    model = build_model(family, "debug", seed=3)
    save_hf_checkpoint(model, tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    back = load_hf_checkpoint(tmp_path / "a")
    tokens = torch.randint(0, model.args.vocab_size, (2, 20))
    assert max_logit_diff(hf, model, tokens) < tol(family)
    for (n, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_sharded_checkpoint_loads(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama_untied_theta"]
    model = load_hf_checkpoint(path)
    save_hf_checkpoint(model, tmp_path / "sharded", max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, 300, (1, 16))
    assert max_logit_diff(hf, load_hf_checkpoint(tmp_path / "sharded"), tokens) < LLAMA_TOL
    hf_back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    assert max_logit_diff(hf_back, model, tokens) < LLAMA_TOL


def test_bfloat16_checkpoint_keeps_its_dtype(hf_checkpoints, tmp_path):
    path, _ = hf_checkpoints["llama_gqa_scaled_tied"]
    save_hf_checkpoint(load_hf_checkpoint(path), tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_hf_checkpoint(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_hf_checkpoint(tmp_path / "bf16", dtype=torch.float32).norm.weight.dtype == torch.float32


# -- bad input -------------------------------------------------------------------------------

def _copy(path, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def test_unsupported_architecture_is_named(hf_checkpoints, tmp_path):
    dst = _copy(hf_checkpoints["llama_untied_theta"][0], tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForjaError, match=r"MistralForCausalLM is not supported; forja loads LlamaForCausalLM"):
        load_hf_checkpoint(dst)


def _edit_weights(dst, edit):
    file = dst / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_checkpoints, tmp_path):
    dst = _copy(hf_checkpoints["llama_untied_theta"][0], tmp_path)
    _edit_weights(dst, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ForjaError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_hf_checkpoint(dst)


def test_extra_tensor_is_named(hf_checkpoints, tmp_path):
    dst = _copy(hf_checkpoints["gpt2"][0], tmp_path)
    _edit_weights(dst, lambda t: t.update({"transformer.h.9.attn.c_attn.weight": torch.zeros(2, 2)}))
    with pytest.raises(ForjaError, match=r"unexpected tensor transformer\.h\.9\.attn\.c_attn\.weight"):
        load_hf_checkpoint(dst)


def test_shape_mismatch_names_tensor_and_expected_shape(hf_checkpoints, tmp_path):
    dst = _copy(hf_checkpoints["llama_gqa_scaled_tied"][0], tmp_path)
    _edit_weights(dst, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(ForjaError, match=r"k_proj\.weight has shape \[64, 64\]; .* expects \[16, 64\]"):
        load_hf_checkpoint(dst)


def test_gpt2_conv1d_shape_mismatch_reported_in_hf_layout(hf_checkpoints, tmp_path):
    dst = _copy(hf_checkpoints["gpt2"][0], tmp_path)
    _edit_weights(dst, lambda t: t.update({"transformer.h.0.mlp.c_fc.weight": torch.zeros(256, 64)}))
    with pytest.raises(ForjaError, match=r"c_fc\.weight has shape \[256, 64\]; .* expects \[64, 256\]"):
        load_hf_checkpoint(dst)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ForjaError, match="is not a directory"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(ForjaError, match="has no config.json"):
        load_hf_checkpoint(tmp_path)


def test_save_refuses_non_empty_directory_unless_overwrite(tmp_path):
    model = build_model("llama", "debug")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ForjaError, match="already exists and is not empty"):
        save_hf_checkpoint(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    save_hf_checkpoint(model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind


def test_failed_save_leaves_no_directory(tmp_path, monkeypatch):
    import forja.models.hf as hf_mod

    def fail_halfway(tensors, out, max_shard_bytes):
        (out / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(hf_mod, "_write_shards", fail_halfway)
    with pytest.raises(OSError, match="No space left"):
        save_hf_checkpoint(build_model("llama", "debug"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_model_without_hf_equivalent(tmp_path):
    model = build_model("llama", "debug", qk_norm=True)
    with pytest.raises(ForjaError, match="qk_norm"):
        save_hf_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()
