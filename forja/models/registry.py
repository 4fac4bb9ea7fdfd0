"""The registry of model families: a family's name -> what forja knows about it.

Each family is a package of forja/models whose __init__.py exposes one `SPEC` (a
`ModelSpec`: its model class, its typed args, its sizes, its Hugging Face adapter and its
tensor-parallel plan, as objects and callables). The registry lists the packages, in the
order errors name them; importing it imports every family, so a typo fails at import, not
mid-run. A new family is its package plus one name here.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from forja.errors import ForjaError
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.models.spec import ModelSpec

FAMILY_PACKAGES = ("llama", "gpt2", "deepseek_v3", "qwen3", "qwen3_5", "qwen3_next", "mixtral", "gpt_oss", "olmo2",
                   "olmo3", "olmo_hybrid", "gemma3", "deepseek_v32", "glm5", "nemotron_h", "llama4",
                   "kimi_linear", "gemma4", "deepseek_v4")
"""The family packages under forja/models, each named as its family."""


def _load(package: str) -> ModelSpec:
    spec = importlib.import_module(f"forja.models.{package}").SPEC
    if spec.name != package:
        raise ForjaError(f"forja/models/{package}/__init__.py names its family {spec.name!r}; a family is named "
                         f"as its package: use {package!r}")
    return spec


FAMILIES: dict[str, ModelSpec] = {package: _load(package) for package in FAMILY_PACKAGES}


def get_family(family: str) -> ModelSpec:
    if family not in FAMILIES:
        raise ForjaError(f"unknown model family {family!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def spec_of(args: TransformerArgs) -> ModelSpec:
    """The family whose typed args `args` are."""
    for spec in FAMILIES.values():
        if type(args) is spec.args_cls:
            return spec
    raise ForjaError(f"{type(args).__name__} is not the args of a forja model family")


def family_of(model: Transformer) -> ModelSpec:
    return spec_of(model.args)


def model_args(family: str, flavor: str, **overrides) -> TransformerArgs:
    """The typed arguments of `family`/`flavor`, with fields overridden by keyword."""
    spec = get_family(family)
    if flavor not in spec.flavors:
        raise ForjaError(f"unknown {family} flavor {flavor!r}; known flavors: {', '.join(spec.flavors)}")
    fields = {f.name for f in dataclasses.fields(spec.args_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ForjaError(f"{family} has no model field {unknown[0]!r}; valid fields: {', '.join(sorted(fields))}")
    return spec.args_cls(**{**spec.flavors[flavor], **overrides})


def build_model(family: str, flavor: str, *, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """Build a model with weights initialized from `seed`.

    `device="meta"` returns it uninitialized, for the parallel build order
    (shard, then `to_empty`, then `init_weights(seed)`).
    """
    args = model_args(family, flavor, **overrides)
    return build_from_args(args, device=device, seed=seed, dtype=dtype)


def build_from_args(args: TransformerArgs, *, device: str | torch.device = "cpu", seed: int = 0,
                    dtype: torch.dtype = torch.float32, init: bool = True) -> Transformer:
    """Build from typed arguments; `init=False` leaves weights to be loaded."""
    with torch.device("meta"):
        model = spec_of(args).model_cls(args).to(dtype)  # cast while on meta: costs no memory
    if str(device) == "meta":
        return model
    model = model.to_empty(device=device)
    model.tie_weights()
    if init:
        model.init_weights(seed)
    return model
