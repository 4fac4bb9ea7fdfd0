"""The checks every model family's test file makes against transformers, written once:
random-weight transformers models and their checkpoints (module fixtures), random tokens,
forja's logits against transformers', what a checkpoint stores, parameter counts of
transformers' model on the meta device, checkpoints with an edited config.json or edited
tensors (for the refusal tests), state dicts compared bit for bit, the HF save round trip,
greedy decoding, and float32 / float64 logit differences. The tensor-parallel cases live
in test_tp_families.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from forja.generate import SamplingConfig, generate
from forja.models import load_hf_checkpoint, model_args, save_hf_checkpoint
from tests.helpers import hf_greedy, max_logit_diff, save_hf_models


def random_hf_model(cls_name: str, config: dict, seed: int = 0, *,
                    pick: Callable[[str, torch.Tensor], bool] | None = None,
                    draw: Callable[[torch.Tensor], object] | None = None):
    """transformers' `cls_name` built from `config` on random weights drawn from `seed`, in
    eval mode. The init is wider than transformers' default (0.1): peaked logits and router
    scores, so that greedy choices and routing are no near-ties. Then `draw(p)` changes in
    place each parameter p (named key) where `pick(key, p)`: for those transformers starts
    at a constant (norms, biases), which would hide a weight put in the wrong place."""
    import transformers

    cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    model = cls(cls.config_class(initializer_range=0.1, **config)).eval()
    if pick is not None:
        with torch.no_grad():
            for key, p in model.named_parameters():
                if pick(key, p):
                    draw(p)
    return model


def checkpoint_fixtures(make_hf_model: Callable, names) -> tuple:
    """The module fixtures (checkpoints, loaded) of a family's test file: name -> (directory
    saved by transformers, the transformers model) for each of `names`, made by
    `make_hf_model(name)`; name -> the forja model loaded from that directory (one load
    shared by the module's tests, which must not change it). Assign both at module level."""
    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory):
        return save_hf_models(tmp_path_factory, make_hf_model, names)

    @pytest.fixture(scope="module")
    def loaded(checkpoints):
        return {name: load_hf_checkpoint(path) for name, (path, _) in checkpoints.items()}

    return checkpoints, loaded


def check_logits(hf_model, model, tokens: torch.Tensor, tol: float, *, family: str, flavor: str | None,
                 label: str) -> float:
    """forja's float32 logits on `tokens` within `tol` of transformers' (the figure printed
    under `label`), and, where the checkpoint is a flavor's, its config.json read into
    exactly that flavor's args. Returns the max |logit difference|."""
    if flavor is not None:
        assert model.args == model_args(family, flavor)
    diff = max_logit_diff(hf_model, model, tokens)
    print(f"{label}: max |logit diff| = {diff:.3e}")
    assert diff < tol
    return diff


def random_tokens(n: int, seed: int = 1, *, vocab_size: int) -> torch.Tensor:
    """A (2, n) batch of token ids below `vocab_size`, the same for the same seed."""
    return torch.randint(0, vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


def stored_names(path: Path) -> set[str]:
    """The tensor names in the checkpoint directory `path`'s model.safetensors."""
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def stored_shapes(path: Path) -> dict[str, list[int]]:
    """name -> shape of each tensor in `path`'s model.safetensors (read without loading it)."""
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


def hf_meta_params(config: dict) -> int:
    """Parameters of transformers' model for `config` (what a family's config_from_args
    writes: its first `architectures` entry names the class), built on the meta device."""
    import transformers

    cfg = dict(config)
    cls = getattr(transformers, cfg.pop("architectures")[0])
    cfg.pop("model_type")
    with torch.device("meta"):
        hf = cls(cls.config_class(**cfg))
    return sum(p.numel() for p in hf.parameters())


def edited_checkpoint(src: Path, dst: Path, *, drop: tuple[str, ...] = (),
                      edit_tensors: Callable[[dict], object] | None = None, **changes) -> Path:
    """A copy of checkpoint `src` in `dst` whose config.json has `changes` set and the keys
    `drop` removed. Its tensors are `src`'s, linked rather than copied (a refusal test reads
    only the config), unless `edit_tensors` is given: then it gets the dict of `src`'s
    tensors to change in place, and `dst` holds the result."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    for key in drop:
        cfg.pop(key)
    (dst / "config.json").write_text(json.dumps(cfg))
    for file in src.iterdir():
        if file.name == "config.json" or (edit_tensors is not None and file.name == "model.safetensors"):
            continue
        (dst / file.name).symlink_to(file.resolve())
    if edit_tensors is not None:
        tensors = load_file(src / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Every tensor of a's state dict bit-equal to b's, in order (the same count), the
    failing key named."""
    for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), key


def check_save_round_trip(model, out_dir: Path, *, hf_class: str, tokens: torch.Tensor, tol: float,
                          layout_of: Path | None = None, stored: Callable = stored_names):
    """Save `model` as an HF checkpoint in `out_dir`: its tensors as `layout_of`'s (when given,
    compared by `stored`: names or shapes), forja reads back the same args and bit-equal
    weights, and transformers reads it as `hf_class` with logits on `tokens` within `tol` of
    forja's. Returns (the directory written, transformers' model) for family-specific checks."""
    import transformers

    out = save_hf_checkpoint(model, out_dir)
    if layout_of is not None:
        assert stored(out) == stored(layout_of)
    back = load_hf_checkpoint(out)
    assert back.args == model.args
    assert_same_weights(model, back)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == hf_class
    assert max_logit_diff(reloaded, model, tokens) < tol
    return out, reloaded


def assert_greedy_equal(hf_model, model, prompt: torch.Tensor, new_tokens: int) -> None:
    """forja's greedy `generate` through its KV cache equals transformers' for `new_tokens`."""
    ref = hf_greedy(hf_model, prompt, new_tokens)
    assert torch.equal(generate(model, prompt, SamplingConfig(max_new_tokens=new_tokens)), ref)


class Float64Diffs(NamedTuple):
    """max |logit difference| figures of one float64 comparison, and the copies made for it."""

    hf_rounding: float  # transformers' own float32 logits from its float64 ones
    float64: float  # forja in float64 from transformers in float64
    hf64: torch.nn.Module
    model64: torch.nn.Module
    exact: torch.Tensor  # transformers' float64 logits


def float64_diffs(hf_model, model, tokens: torch.Tensor) -> Float64Diffs:
    """Compare forja with transformers both in float64 (deep copies; the float32 models are
    left as they are), and how far transformers' own float32 logits are from its float64
    ones: the rounding error a float32 model is allowed."""
    hf64, model64 = copy.deepcopy(hf_model).double(), copy.deepcopy(model).double()
    with torch.no_grad():
        exact = hf64(tokens).logits
        hf_rounding = (hf_model(tokens).logits.double() - exact).abs().max().item()
        diff64 = (model64(tokens) - exact).abs().max().item()
    return Float64Diffs(hf_rounding, diff64, hf64, model64, exact)
