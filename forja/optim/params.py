"""Which parameters an optimizer's own update takes (Muon's orthogonalization, SOAP's
preconditioning), and which go to its AdamW groups.

Rule: the own update takes the hidden matrices, parameters with two or more dimensions
(3-D: stacked experts), except those whose rows are not a linear map between hidden features:

- token, position and value embeddings (a lookup table: each row is updated only by its own tokens),
- the output projection (its rows are per-token logits; Muon's and SOAP's practice keeps it on
  AdamW; its vocabulary side would also make SOAP's factors vocab x vocab),
- MoE routers (a small E x D gate whose rows compete through the softmax).

Everything else (those, norms, biases) goes to AdamW. Each optimizer's `adamw_patterns` and
own patterns (`optim.muon.muon_patterns`, `optim.soap.soap_patterns`; fnmatch on canonical
names, e.g. "layers.*.attention.wo.weight") override the rule, adamw_patterns first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

from torch import nn

from forja.names import named_unique_parameters
from forja.optim.config import OptimConfig

# Canonical names (forja/models/common/init.py) the rule keeps on AdamW though >= 2-D.
ADAMW_BY_RULE = ("tok_embeddings.weight", "mtp.embed.weight", "pos_embeddings.weight", "value_embeds.*.weight",
                 "output.weight", "*.router.gate.weight")


def takes_own_update(name: str, ndim: int, adamw_patterns: Sequence[str], own_patterns: Sequence[str]) -> bool:
    """Whether the parameter `name` (canonical) of `ndim` dimensions is a hidden matrix, the
    rule above with an optimizer's patterns overriding it (adamw_patterns first)."""
    if any(fnmatchcase(name, p) for p in adamw_patterns):
        return False
    if any(fnmatchcase(name, p) for p in own_patterns):
        return True
    return ndim >= 2 and not any(fnmatchcase(name, p) for p in ADAMW_BY_RULE)


def goes_to_muon(name: str, ndim: int, cfg: OptimConfig) -> bool:
    """Whether the parameter `name` (canonical) of `ndim` dimensions is Muon's."""
    return takes_own_update(name, ndim, cfg.muon.adamw_patterns, cfg.muon.muon_patterns)


def goes_to_soap(name: str, ndim: int, cfg: OptimConfig) -> bool:
    """Whether the parameter `name` (canonical) of `ndim` dimensions is preconditioned by SOAP."""
    return takes_own_update(name, ndim, cfg.soap.adamw_patterns, cfg.soap.soap_patterns)


def muon_split(model: nn.Module, cfg: OptimConfig) -> dict[str, list[str]]:
    """Canonical parameter names by destination: {"muon": [...], "adamw": [...]}."""
    split: dict[str, list[str]] = {"muon": [], "adamw": []}
    for name, param in named_unique_parameters(model):
        if param.requires_grad:
            split["muon" if goes_to_muon(name, param.dim(), cfg) else "adamw"].append(name)
    return split


def _split_groups(model: nn.Module, cfg: OptimConfig, own: str, flag: str, takes: Callable[[str, int], bool],
                  adamw_lr: float) -> list[dict]:
    """Up to three groups, empty ones left out: `own` (the optimizer's own update, lr = optim.lr,
    decayed), AdamW's "matrices" (decayed) and AdamW's "vectors" (not decayed), each carrying
    `flag` (True on `own` only); `takes(name, ndim)` says which parameters are `own`'s."""
    mine, decay, no_decay = [], [], []
    for name, param in named_unique_parameters(model):  # a tied weight once, under its first name
        if not param.requires_grad:
            continue
        if takes(name, param.dim()):
            mine.append(param)
        else:
            (decay if param.dim() >= 2 else no_decay).append(param)
    # Named like param_groups' groups, so schedule.groups can address them.
    groups = [{"params": mine, flag: True, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "name": own},
              {"params": decay, flag: False, "lr": adamw_lr, "weight_decay": cfg.weight_decay, "name": "matrices"},
              {"params": no_decay, flag: False, "lr": adamw_lr, "weight_decay": 0.0, "name": "vectors"}]
    return [g for g in groups if g["params"]]


def muon_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """"muon", "matrices" and "vectors" (AdamW's lr: optim.muon.adamw_lr or optim.lr), each
    with its `use_muon` flag, which `forja.optim.muon.Muon` reads."""
    adamw_lr = cfg.muon.adamw_lr if cfg.muon.adamw_lr is not None else cfg.lr
    return _split_groups(model, cfg, "muon", "use_muon", lambda n, d: goes_to_muon(n, d, cfg), adamw_lr)


def soap_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """"soap", "matrices" and "vectors" (all at optim.lr), each with its `precondition` flag,
    which `forja.optim.soap.Soap` reads: the AdamW groups take its plain Adam step."""
    return _split_groups(model, cfg, "soap", "precondition", lambda n, d: goes_to_soap(n, d, cfg), cfg.lr)
