"""What every model family's tests share: a family's `FamilyCase` (its transformers configs,
tolerances, published sizes, decoding lengths and refusals: the data test_conformance.py
checks every registered family against), the session's random-weight transformers models
and their checkpoints (`CheckpointStore`, built once whichever test asks first), and the
checks themselves: forja's logits against transformers', what a checkpoint stores,
parameter counts of transformers' model on the meta device, checkpoints with an edited
config.json or edited tensors (for the refusal tests), state dicts compared bit for bit,
the HF save round trip, greedy decoding, and float32 / float64 logit differences. The
tensor-parallel cases live in test_tp_families.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from forja.generate import SamplingConfig, generate
from forja.models import load_hf_checkpoint, model_args, save_hf_checkpoint
from tests.helpers import hf_greedy, max_logit_diff
from tests.unit.models.float64_casts import keep_float64


@dataclass(frozen=True)
class HFConfig:
    """One transformers model a family is checked against."""

    cls: str
    """transformers' class, e.g. "LlamaForCausalLM"."""
    config: dict
    """Its config kwargs: small, but each exercising a feature of the family."""
    flavor: str | None = None
    """The forja flavor whose args config.json must read into exactly, or None."""


@dataclass(frozen=True, kw_only=True)
class FamilyCase:
    """What test_conformance.py checks one family against. A family's test file (test_<family>.py)
    defines `CASE`; the family-specific tests beside it reach the same checkpoints."""

    family: str
    configs: dict[str, HFConfig]
    tol: float
    """Bound on max |logit difference| from transformers' in float32 (the file says what was measured)."""
    float64_tol: float = 1e-10
    """Bound on it with both sides in float64 (looser only where a piece cannot be computed
    alike: the family's file says which and why)."""
    float64_kept: tuple[str, ...] = ()
    """transformers' functions that compute a piece in float32 whatever the dtype, where forja
    computes it at least in float32 (float64 in a float64 model), by their paths under
    transformers.models ("mixtral.modeling_mixtral.MixtralTopKRouter.forward"): the float64
    comparisons run them in float64 (float64_casts.py), so both sides compute one function."""
    float64_fix: Callable[[torch.nn.Module, pytest.MonkeyPatch], None] | None = None
    """(transformers' float64 model, monkeypatch) -> None: what else the float64 comparisons
    need of it to compute forja's function (float64_casts.py: a constant `.double()` cannot
    make exact, a float32 table computed otherwise)."""
    tokens: int = 48
    """Logits are compared over a (2, tokens) batch."""
    make: Callable[[str, HFConfig, int], torch.nn.Module] | None = None
    """(name, config, seed) -> transformers' model; None: `random_hf_model` with `pick`/`draw`."""
    pick: Callable[[str, torch.Tensor], bool] | None = None
    draw: Callable[[torch.Tensor], object] | None = None
    logits: Callable | None = None
    """(case, name, hf_model, model, tokens, monkeypatch) -> max |logit difference| in float32 and
    in float64: the comparison when it is more than that difference < tol (float64 references,
    its own float64 bounds); None: `check_logits`, and float64 in its own test."""
    layout: Callable[[Path], object] | None = None
    """What a save must write as transformers' checkpoint holds it (`stored_names`, `stored_shapes`);
    None: not compared."""
    same_tensors: bool = False
    """A save writes transformers' checkpoint back tensor for tensor."""
    after_round_trip: Callable | None = None
    """(name, model, reloaded transformers model, case checkpoints) -> None: the family's further checks."""
    greedy: dict[str, int] = field(default_factory=dict)
    """Config name -> new tokens greedy decoding must equal transformers' `generate` over."""
    uncached: bool = False
    """Greedy decoding without the cache must equal it too."""
    export_flavors: tuple[str, ...] = ("debug",)
    prepare_export: Callable[[torch.nn.Module], None] | None = None
    """Gives the exported model weights transformers would not start at (norm offsets, biases)."""
    export_tokens: int = 20
    export_tol: float | None = None
    """The exported model's bound (None: `tol`)."""
    published: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Flavor -> its counts: num_params(), then num_active_params() and without the embedding, as many as given."""
    hf_config: Callable[[str], dict] | None = None
    """Flavor -> the config.json transformers builds it from (None: the family's config_from_args)."""
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Config name -> tensors transformers 5's fused-experts layout (save_original_format=False) holds."""
    refusals: tuple[tuple[str, dict, str], ...] = ()
    """(config name, config.json changes, message) of each config.json forja refuses."""
    refusal_prefix: str = r"^config\.json: "
    """What each refusal's message starts with."""
    export_refusals: tuple[tuple[dict, str], ...] = ()
    """(overrides of `refusal_flavor`, message) of each model forja refuses to export."""
    refusal_flavor: str = "debug"


class FamilyCheckpoints:
    """A family's transformers models and checkpoints, name -> (directory, model), each built
    on first use and kept for the session; `loaded(name)` the forja model read from it (one
    load shared by every test, which must not change it)."""

    def __init__(self, case: FamilyCase, store: dict, tmp_path_factory):
        self.case, self.store, self.tmp = case, store, tmp_path_factory

    def __getitem__(self, name: str) -> tuple[Path, torch.nn.Module]:
        key = (self.case.family, name)
        if key not in self.store:
            hf = make_hf_model(self.case, name)
            path = self.tmp.mktemp(f"{self.case.family}-{name}")
            hf.save_pretrained(path)
            self.store[key] = (path, hf)
        return self.store[key]

    def loaded(self, name: str):
        key = (self.case.family, name, "forja")
        if key not in self.store:
            self.store[key] = load_hf_checkpoint(self[name][0])
        return self.store[key]


def make_hf_model(case: FamilyCase, name: str, seed: int = 0) -> torch.nn.Module:
    config = case.configs[name]
    if case.make is not None:
        return case.make(name, config, seed)
    return random_hf_model(config.cls, config.config, seed, pick=case.pick, draw=case.draw)


def family_fixtures(case: FamilyCase, prefix: str = "") -> tuple:
    """A family test file's fixtures over the session's store (conftest.py's `hf_store`):
    `checkpoints` (name -> (directory, transformers' model)) and `loaded` (name -> the forja
    model read from it), their names after `prefix`. Assign both at module level."""
    @pytest.fixture(scope="module", name=prefix + "checkpoints")
    def checkpoints(hf_store, tmp_path_factory):
        return FamilyCheckpoints(case, hf_store, tmp_path_factory)

    @pytest.fixture(scope="module", name=prefix + "loaded")
    def loaded(hf_store, tmp_path_factory):
        return _Loaded(FamilyCheckpoints(case, hf_store, tmp_path_factory))

    return checkpoints, loaded


class _Loaded:
    def __init__(self, checkpoints: FamilyCheckpoints):
        self.checkpoints = checkpoints

    def __getitem__(self, name: str):
        return self.checkpoints.loaded(name)


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


def hf_document_masks(docs: torch.Tensor, local_kind: str, local: Callable) -> dict[str, torch.Tensor]:
    """transformers' additive (B, 1, T, T) masks per layer type for packed rows `docs` (B, T):
    causal within each document for "full_attention", and for `local_kind` also where
    `local(q, k)` ((T, 1) and (1, T) positions) holds (a window, a chunk)."""
    T = docs.shape[1]
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = (docs[:, :, None] == docs[:, None, :]) & (q >= k)  # (B, T, T)
    masks = {"full_attention": seen, local_kind: seen & local(q, k)}
    low = torch.finfo(torch.float32).min
    return {kind: torch.zeros(m.shape).masked_fill(~m, low)[:, None] for kind, m in masks.items()}


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


def assert_greedy_equal(hf_model, model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """forja's greedy `generate` through its KV cache equals transformers' for `new_tokens`;
    returns it."""
    ref = hf_greedy(hf_model, prompt, new_tokens)
    out = generate(model, prompt, SamplingConfig(max_new_tokens=new_tokens))
    assert out.shape == (prompt.shape[0], prompt.shape[1] + new_tokens)
    assert torch.equal(out, ref)
    return out


class Float64Diffs(NamedTuple):
    """max |logit difference| figures of one float64 comparison, and the copies made for it."""

    hf_rounding: float  # transformers' own float32 logits from its float64 ones
    float64: float  # forja in float64 from transformers in float64
    hf64: torch.nn.Module
    model64: torch.nn.Module
    exact: torch.Tensor  # transformers' float64 logits


def hybrid_logits(case: FamilyCase, name: str, hf_model, model, tokens: torch.Tensor,
                  monkeypatch) -> tuple[float, float]:
    """A Gated DeltaNet family's logits against transformers'. In float32 the two round the
    delta rule apart, which small peaked models amplify: held to transformers' own float32
    error from its float64 logits, and where the model has no experts to `case.tol`. In float64
    to `case.float64_tol` (1e-10: the same function, transformers' float32 pieces in float64 as
    forja's, the routers' included: `case.float64_kept`)."""
    flavor = case.configs[name].flavor
    if flavor is not None:  # config.json read into exactly the flavor's args
        assert model.args == model_args(case.family, flavor)
    diff = max_logit_diff(hf_model, model, tokens)
    hf_model.config._experts_implementation = "eager"  # transformers' grouped_mm has no float64
    hf_rounding, diff64, *_ = float64_diffs(hf_model, model, tokens, case)
    print(f"{name}: max |logit diff| float32 {diff:.3e} (transformers' own float32 error {hf_rounding:.3e}), "
          f"float64 {diff64:.3e}")
    assert diff < hf_rounding and diff64 < case.float64_tol
    if model.args.n_experts == 0:
        assert diff < case.tol
    return diff, diff64


def float64_diffs(hf_model, model, tokens: torch.Tensor, case: FamilyCase | None = None) -> Float64Diffs:
    """Compare forja with transformers both in float64 (deep copies; the float32 models are
    left as they are), transformers' float32 pieces in float64 too as `case` says
    (float64_kept, float64_fix), and how far transformers' own float32 logits are from its
    float64 ones: the rounding error a float32 model is allowed."""
    hf64, model64 = copy.deepcopy(hf_model).double(), copy.deepcopy(model).double()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        if case is not None:
            keep_float64(mp, case.float64_kept)
            if case.float64_fix is not None:
                case.float64_fix(hf64, mp)
        exact = hf64(tokens).logits
        hf_rounding = (hf_model(tokens).logits.double() - exact).abs().max().item()
        diff64 = (model64(tokens) - exact).abs().max().item()
    return Float64Diffs(hf_rounding, diff64, hf64, model64, exact)
