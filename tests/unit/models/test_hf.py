"""Hugging Face interop beyond each family's conformance (test_conformance.py): sharded and
bfloat16 checkpoints, and bad checkpoints stop with one error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
from tests.helpers import max_logit_diff
from tests.unit.models.family_checks import family_fixtures
from tests.unit.models.test_gpt2 import CASE as GPT2
from tests.unit.models.test_llama import CASE as LLAMA

transformers = pytest.importorskip("transformers")

checkpoints, _ = family_fixtures(LLAMA)
gpt2_checkpoints, _ = family_fixtures(GPT2, "gpt2_")
LLAMA_TOL = LLAMA.tol


def test_sharded_checkpoint_loads(checkpoints, tmp_path):
    path, hf = checkpoints["untied_theta"]
    model = load_hf_checkpoint(path)
    save_hf_checkpoint(model, tmp_path / "sharded", max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, 300, (1, 16))
    assert max_logit_diff(hf, load_hf_checkpoint(tmp_path / "sharded"), tokens) < LLAMA_TOL
    hf_back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    assert max_logit_diff(hf_back, model, tokens) < LLAMA_TOL


def test_bfloat16_checkpoint_keeps_its_dtype(checkpoints, tmp_path):
    path, _ = checkpoints["gqa_scaled_tied"]
    save_hf_checkpoint(load_hf_checkpoint(path), tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_hf_checkpoint(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_hf_checkpoint(tmp_path / "bf16", dtype=torch.float32).norm.weight.dtype == torch.float32


# -- bad input -------------------------------------------------------------------------------

def _copy(path, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def test_unsupported_architecture_is_named(checkpoints, tmp_path):
    dst = _copy(checkpoints["untied_theta"][0], tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ForjaError, match=r"MistralForCausalLM is not supported; forja loads LlamaForCausalLM"):
        load_hf_checkpoint(dst)


_BAD_TENSORS = {
    "missing": (("llama", "untied_theta"), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"),
    "extra": (("gpt2", "gpt2"), lambda t: t.update({"transformer.h.9.attn.c_attn.weight": torch.zeros(2, 2)}),
              r"unexpected tensor transformer\.h\.9\.attn\.c_attn\.weight"),
    "misshapen": (("llama", "gqa_scaled_tied"),
                  lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
                  r"k_proj\.weight has shape \[64, 64\]; .* expects \[16, 64\]"),
    # GPT-2's Conv1D weight is reported in the Hugging Face layout, not forja's transpose.
    "misshapen_conv1d": (("gpt2", "gpt2"),
                         lambda t: t.update({"transformer.h.0.mlp.c_fc.weight": torch.zeros(256, 64)}),
                         r"c_fc\.weight has shape \[256, 64\]; .* expects \[64, 256\]"),
}


@pytest.mark.parametrize("case", list(_BAD_TENSORS))
def test_a_bad_tensor_is_named(checkpoints, gpt2_checkpoints, tmp_path, case):
    (family, name), edit, message = _BAD_TENSORS[case]
    source = (checkpoints if family == "llama" else gpt2_checkpoints)[name][0]
    dst = _copy(source, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ForjaError, match=message):
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
