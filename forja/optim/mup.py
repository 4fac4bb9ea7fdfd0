"""muP's learning rates (Yang et al. 2021, "Tensor Programs V"), for Adam-type updates.

With width multiplier m = model.dim / model.mup_base_dim, a hidden weight (>= 2-D: attention
and MLP matrices, experts, routers) takes Adam's learning rate divided by m: Adam's update
has entries of size ~lr whatever the fan-in, so a fan-in m times wider would move the next
activation m times more. Embeddings, the output projection (its logits carry the 1/m output
multiplier instead; the model does it) and vectors (norms, biases) keep the base learning
rate. The init side lives with the model (`forja.models.common.transformer.mup_init_rule`).

Muon: its own groups are left alone. Its orthogonalized update already has the spectral
size its shape calls for (update_scale "spectral": sqrt(fan_out / fan_in); "rms_match":
matched to AdamW's RMS at every width), which transfers across widths by construction; only
its AdamW groups get the rule above.

The model carries m (`args.mup_width_mult`); this module reads it by attribute, importing
nothing of forja.models.
"""

from __future__ import annotations

from torch import nn

from forja.names import named_unique_parameters

# Canonical names (forja/models/common/init.py) that keep the base lr though >= 2-D.
BASE_LR = ("tok_embeddings.weight", "mtp.embed.weight", "pos_embeddings.weight", "output.weight")


def width_mult_of(model: nn.Module) -> float:
    """The muP width multiplier the model was built with; 1 (muP off) when it has none."""
    return float(getattr(getattr(model, "args", None), "mup_width_mult", 1.0))


def mup_lr_scale(name: str, ndim: int, width_mult: float) -> float:
    """The factor on Adam's learning rate of the parameter `name` (canonical) of `ndim` dims."""
    if width_mult == 1.0 or ndim < 2 or name in BASE_LR:
        return 1.0
    return 1.0 / width_mult


def apply_mup(model: nn.Module, groups: list[dict], base_lr: float) -> list[dict]:
    """`groups` with each Adam-type group split by muP's lr factor, the scaled part first;
    each part keeps its group's keys and name (so `schedule.groups` still addresses it; the
    scheduler multiplies every group's own initial lr). Groups with `use_muon` stay whole.
    Unchanged when the model's width multiplier is 1."""
    mult = width_mult_of(model)
    if mult == 1.0:
        return groups
    names = {id(p): name for name, p in named_unique_parameters(model)}
    out = []
    for group in groups:
        if group.get("use_muon", False):
            out.append(group)
            continue
        by_scale: dict[float, list] = {}
        for p in group["params"]:
            by_scale.setdefault(mup_lr_scale(names[id(p)], p.dim(), mult), []).append(p)
        lr = group.get("lr", base_lr)
        for scale in sorted(by_scale):
            out.append({**group, "params": by_scale[scale], "lr": lr * scale})
    return out
