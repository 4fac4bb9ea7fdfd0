"""float8 training through torchao: Linear layers compute their matmuls in float8.

`tensorwise` scales each tensor by one number (fastest); `rowwise` scales each row of the
inputs and each column of the weights (more accurate, for large models). Weights, their
gradients and the optimizer stay in high precision; torchao casts on the fly.

Small layers do not gain: their matmuls are too short for float8's speed to pay for the
casts (torchtitan measures the crossover around 1-2k features on H100), so layers with
fewer input or output features than `min_features` stay as they are, as does the output
projection (precision matters most at the logits). On CPU, torchao emulates float8,
which is how it is tested without a GPU.

float8 that converts no layer is refused rather than run silently in high precision: the
planner and the run's throughput would count on float8 matmuls that never happen.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from forja import fallbacks
from forja.errors import ForjaError


def float8_filter(min_features: int):
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
            return False
        # float8 matmuls need dimensions divisible by 16.
        dims = (module.in_features, module.out_features)
        return all(d % 16 == 0 for d in dims) and min(dims) >= min_features

    return keep


def apply_float8(model: nn.Module, recipe: str, *, device: torch.device, min_features: int) -> int:
    """Swap eligible Linear layers of `model` for torchao's Float8Linear; returns how many.
    Parameter names do not change, so checkpoints load with or without float8."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ForjaError("train.float8 needs torchao: pip install 'forja[float8]' (or set train.float8 = 'none')") \
            from None
    check_float8(model, recipe, min_features)
    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
        fallbacks.record("float8.emulated", asked=f"train.float8 = '{recipe}'", instead="float8 emulated in high "
                         "precision (slower than without float8)", why=f"{device.type} has no float8 matmul",
                         fix="train on a GPU with float8 matmuls (H100 or newer), or set train.float8 = 'none'")
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(min_features))
    return before - sum(type(m) is nn.Linear for m in model.modules())


def check_float8(model: nn.Module, recipe: str, min_features: int) -> None:
    """Stop if float8 would convert none of `model`'s Linear layers (a meta model will do,
    so a preflight can ask before anything is built)."""
    keep = float8_filter(min_features)
    named = list(model.named_modules())
    if any(keep(m, name) for name, m in named):
        return
    layers = {name: (m.in_features, m.out_features) for name, m in named
              if isinstance(m, nn.Linear) and name.split(".")[-1] != "output"}
    if not layers:
        raise ForjaError(f"train.float8 = '{recipe}' converts no Linear layer: this model has none but its "
                         "output projection, which stays high precision; set train.float8 = 'none'")
    name, (n_in, n_out) = max(layers.items(), key=lambda kv: min(kv[1]))
    raise ForjaError(f"train.float8 = '{recipe}' converts no Linear layer: the largest, {name}, has {n_in} input "
                     f"and {n_out} output features, and a layer needs both divisible by 16 and at least "
                     f"train.float8_min_features = {min_features}; set train.float8_min_features = "
                     f"{min(n_in, n_out)} (float8 gains little on layers this small) or train.float8 = 'none'")
