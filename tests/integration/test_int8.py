"""`--quantize int8` (weight-only, torchao) for `forja eval` and `forja generate`: what it costs
in log-likelihood and what it saves in bytes, on a short trained run."""

from __future__ import annotations

import json

import pytest
import torch

from forja.cli import main
from forja.eval.cli import load_model
from forja.eval.tasks import SHIPPED
from forja.models.quantize import cast, quantize, weight_bytes

from .conftest import train_args

TEXT = SHIPPED / "python_text.jsonl"


@pytest.fixture(scope="module")
def run(tmp_path_factory, train_data):
    run = tmp_path_factory.mktemp("int8") / "run"
    changes = {"train.steps": "24", "checkpoint.interval": "24", "train.val_interval": "0", "train.sample_tokens": "0"}
    assert main(train_args(run, train_data, **changes)) == 0
    return run


def _eval(run, capsys, how: str) -> dict:
    capsys.readouterr()
    assert main(["eval", str(run), "--task", str(TEXT), "--json", "--quantize", how]) == 0
    return json.loads(capsys.readouterr().out)


def test_int8_scores_close_to_fp32_with_fewer_bytes_than_bf16(run, capsys):
    full, int8 = _eval(run, capsys, "none"), _eval(run, capsys, "int8")
    bpb, bpb8 = full["tasks"][0]["bits_per_byte"], int8["tasks"][0]["bits_per_byte"]
    print(f"bits/byte fp32 {bpb:.5f}, int8 {bpb8:.5f} ({(bpb8 - bpb) / bpb:+.3%}); weights fp32 "
          f"{full['weight_bytes']:,} B, int8 {int8['weight_bytes']:,} B")
    assert bpb8 != bpb and abs(bpb8 - bpb) / bpb < 0.01
    model, _, _ = load_model(run)
    bf16 = weight_bytes(cast(model, "bfloat16"))
    int8_bf16 = weight_bytes(quantize(model, "int8"))  # the rest of the weights in bf16
    print(f"weights bf16 {bf16:,} B, int8 with bf16 embedding and norms {int8_bf16:,} B ({int8_bf16 / bf16:.2f}x)")
    assert int8["weight_bytes"] < full["weight_bytes"] and int8_bf16 < 0.75 * bf16


def test_int8_stores_each_linear_weight_in_one_byte_per_value(run):
    model, _, _ = load_model(run)
    assert model.args.tie_embeddings  # the debug model: its output projection is the embedding
    linear = {n: m.weight.shape for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantize(model, "int8")
    # The tied projection stays the embedding's one weight: an int8 copy would store it twice.
    assert model.output.weight is model.tok_embeddings.weight and type(model.output.weight) is torch.nn.Parameter
    del linear["output"]
    for name, (out_features, in_features) in linear.items():
        weight = model.get_submodule(name).weight
        # A torchao tensor subclass: its inner tensors (torch's subclass protocol) hold the int8
        # values, one per weight, and one scale per output channel.
        inner = [getattr(weight, attr) for attr in weight.__tensor_flatten__()[0]]
        values = [t for t in inner if t.shape == (out_features, in_features)]
        assert [t.dtype for t in values] == [torch.int8], name
        assert sum(t.numel() for t in inner if t.shape != (out_features, in_features)) <= 2 * out_features, name


def test_generate_runs_in_int8(run, capsys):
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--quantize", "int8"]) == 0
    assert capsys.readouterr().out.startswith("def ")
