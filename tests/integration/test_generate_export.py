"""`forja generate` and `forja export` from the command line."""

from __future__ import annotations

import pytest
import torch

from forja.cli import main
from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint

from .conftest import train_args

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, train_data):
    run = tmp_path_factory.mktemp("gen") / "run"
    assert main(train_args(run, train_data, **{"train.steps": "6"})) == 0
    return run


def test_generate_without_a_tokenizer_says_so(tmp_path, capsys):
    save_hf_checkpoint(build_model("llama", "debug"), tmp_path / "hf")
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "x", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json, so text cannot be turned into tokens" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_generate_from_a_run_directory(trained_run, capsys):
    assert main(["generate", str(trained_run), "--prompt", "def load(", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def load(") and len(out) > len("def load(\n")


def test_export_then_transformers_loads_model_and_tokenizer(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(trained_run), "--hf", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("import json\ndef dump(obj):", return_tensors="pt").input_ids
    ours = load_hf_checkpoint(out)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() < 1e-6  # measured 0.0 (Llama)
    assert tok.decode(ids[0]) == "import json\ndef dump(obj):"
    assert hf.config.eos_token_id == tok.eos_token_id is not None
    # The exported directory also serves `forja generate`.
    assert main(["generate", str(out), "--prompt", "import", "--max-new-tokens", "4"]) == 0
    # A second export into the same directory is refused unless told to overwrite.
    assert main(["export", str(trained_run), "--hf", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(trained_run / "checkpoints" / "step-00000004"), "--hf", str(out),
                 "--overwrite"]) == 0


def test_export_of_something_else_is_refused(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "out")]) == 2
    assert "is neither a forja run directory" in capsys.readouterr().err


def test_export_without_transformers_says_how_to_get_it(trained_run, tmp_path, capsys, monkeypatch):
    """After `make train` alone transformers is not installed: the export still writes, and its
    line says which extra brings transformers (the [hf] extra, which holds it)."""
    import sys
    from pathlib import Path

    import tomllib

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: its import fails
    assert main(["export", str(trained_run), "--hf", str(tmp_path / "hf")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"forja: wrote {tmp_path / 'hf'} (load it with transformers.") and \
        "transformers is not installed here (make train leaves it out): pip install -e '.[hf]'" in line
    monkeypatch.delitem(sys.modules, "transformers")
    assert main(["export", str(trained_run), "--hf", str(tmp_path / "hf2")]) == 0
    assert "not installed" not in capsys.readouterr().out  # installed (make test): the plain line
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(req.startswith("transformers") for req in extras["hf"])
