"""Which parameters Muon takes, and which go to its AdamW groups.

Rule: Muon takes the hidden matrices, parameters with two or more dimensions (3-D: stacked
experts), except those whose rows are not a linear map between hidden features:

- token and position embeddings (a lookup table: each row is updated only by its own tokens),
- the output projection (its rows are per-token logits; Muon's papers keep it on AdamW),
- MoE routers (a small E x D gate whose rows compete through the softmax).

Everything else (those, norms, biases) goes to AdamW. `optim.muon.adamw_patterns` and
`optim.muon.muon_patterns` (fnmatch on canonical names, e.g. "layers.*.attention.wo.weight")
override the rule, adamw_patterns first.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from forja.names import named_unique_parameters
from forja.optim.config import OptimConfig

# Canonical names (forja/models/common/init.py) the rule keeps on AdamW though >= 2-D.
ADAMW_BY_RULE = ("tok_embeddings.weight", "mtp.embed.weight", "pos_embeddings.weight", "output.weight",
                 "*.router.gate.weight")


def goes_to_muon(name: str, ndim: int, cfg: OptimConfig) -> bool:
    """Whether the parameter `name` (canonical) of `ndim` dimensions is Muon's."""
    if any(fnmatchcase(name, p) for p in cfg.muon.adamw_patterns):
        return False
    if any(fnmatchcase(name, p) for p in cfg.muon.muon_patterns):
        return True
    return ndim >= 2 and not any(fnmatchcase(name, p) for p in ADAMW_BY_RULE)


def muon_split(model: nn.Module, cfg: OptimConfig) -> dict[str, list[str]]:
    """Canonical parameter names by destination: {"muon": [...], "adamw": [...]}."""
    split: dict[str, list[str]] = {"muon": [], "adamw": []}
    for name, param in named_unique_parameters(model):
        if param.requires_grad:
            split["muon" if goes_to_muon(name, param.dim(), cfg) else "adamw"].append(name)
    return split


def muon_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Up to three groups, empty ones left out: "muon" (lr = optim.lr, decayed), AdamW's
    "matrices" (lr = optim.muon.adamw_lr or optim.lr, decayed) and AdamW's "vectors" (not decayed).
    Each carries `use_muon`, which `forja.optim.muon.Muon` reads."""
    adamw_lr = cfg.muon.adamw_lr if cfg.muon.adamw_lr is not None else cfg.lr
    muon, decay, no_decay = [], [], []
    for name, param in named_unique_parameters(model):  # a tied weight once, under its first name
        if not param.requires_grad:
            continue
        if goes_to_muon(name, param.dim(), cfg):
            muon.append(param)
        else:
            (decay if param.dim() >= 2 else no_decay).append(param)
    # Named like param_groups' groups, so schedule.groups can address them.
    groups = [{"params": muon, "use_muon": True, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": "muon"},
              {"params": decay, "use_muon": False, "lr": adamw_lr, "weight_decay": cfg.weight_decay,
               "name": "matrices"},
              {"params": no_decay, "use_muon": False, "lr": adamw_lr, "weight_decay": 0.0, "name": "vectors"}]
    return [g for g in groups if g["params"]]
