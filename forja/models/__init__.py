"""Model families: a registry from family name to its model, sizes and adapters.

    from forja.models import build_model, load_hf_checkpoint, save_hf_checkpoint
    model = build_model("llama", "debug")           # random weights from a seed
    model = load_hf_checkpoint("path/to/hf_dir")     # a Hugging Face checkpoint
    save_hf_checkpoint(model, "out_dir")            # transformers can load it
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from forja.errors import ForjaError
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.models.gpt2.flavors import FLAVORS as GPT2_FLAVORS
from forja.models.gpt2.model import GPT2, GPT2Args
from forja.models.llama.flavors import FLAVORS as LLAMA_FLAVORS
from forja.models.llama.model import Llama, LlamaArgs


@dataclass(frozen=True)
class ModelSpec:
    """What forja knows about one family."""

    name: str
    model_cls: type[Transformer]
    args_cls: type[TransformerArgs]
    flavors: dict[str, dict]
    hf_adapter: str  # module holding the Hugging Face adapter, imported on use
    parallelize: str  # "module:function" applying TP/AC/compile/FSDP, imported on use


FAMILIES: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", Llama, LlamaArgs, LLAMA_FLAVORS, "forja.models.llama.hf",
                       "forja.models.llama.parallelize:parallelize_llama"),
    "gpt2": ModelSpec("gpt2", GPT2, GPT2Args, GPT2_FLAVORS, "forja.models.gpt2.hf",
                      "forja.models.gpt2.parallelize:parallelize_gpt2"),
}


def get_family(family: str) -> ModelSpec:
    if family not in FAMILIES:
        raise ForjaError(f"unknown model family {family!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[family]


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


def family_of(model: Transformer) -> ModelSpec:
    for spec in FAMILIES.values():
        if type(model) is spec.model_cls:
            return spec
    raise ForjaError(f"{type(model).__name__} is not a forja model family")


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
    spec = next(s for s in FAMILIES.values() if type(args) is s.args_cls)
    with torch.device("meta"):
        model = spec.model_cls(args).to(dtype)  # cast while on meta: costs no memory
    if str(device) == "meta":
        return model
    model = model.to_empty(device=device)
    model.tie_weights()
    if init:
        model.init_weights(seed)
    return model


from forja.models.hf import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402  (needs FAMILIES)

__all__ = ["FAMILIES", "ModelSpec", "build_model", "build_from_args", "family_of", "get_family",
           "load_hf_checkpoint", "model_args", "save_hf_checkpoint"]
