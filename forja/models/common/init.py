"""Deterministic weight initialization that does not depend on how a model is sharded.

Every parameter draws its values from its own generator, seeded by the run seed and
the parameter's name, and the full tensor is drawn on the CPU in float32. A sharded
parameter (a DTensor under FSDP or tensor parallelism) then keeps its own slice of
that full tensor. So the same seed gives bit-identical weights on one CPU, one GPU or
any parallel layout, and adding or removing a layer does not shift the others.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from forja.names import named_unique_parameters

# A rule maps a parameter name to ("normal", std), ("trunc_normal", std), ("ones",), ("zeros",),
# ("constant", value),
# ("uniform", low, high), ("uniform_log", low, high): the log of a U(low, high) draw (a decay
# rate kept as its log), or ("inv_softplus", low, high, floor): softplus^-1 of a time step drawn
# log-uniformly in [low, high] and at least floor (a bias that softplus turns back into it).
InitRule = Callable[[str], tuple]

def _generator(seed: int, name: str) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def full_value(shape: torch.Size, rule: tuple, gen: torch.Generator) -> torch.Tensor:
    """The full float32 CPU tensor that `rule` gives for a parameter of `shape`."""
    kind = rule[0]
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "constant":
        return torch.full(shape, float(rule[1]))
    out = torch.empty(shape)
    if kind == "normal":
        return out.normal_(0.0, rule[1], generator=gen)
    if kind == "trunc_normal":
        std = rule[1]
        return nn.init.trunc_normal_(out, 0.0, std, -3 * std, 3 * std, generator=gen)
    if kind == "uniform":
        return out.uniform_(rule[1], rule[2], generator=gen)
    if kind == "uniform_log":
        return out.uniform_(rule[1], rule[2], generator=gen).log_()
    if kind == "inv_softplus":
        low, high, floor = rule[1:]
        dt = out.uniform_(math.log(low), math.log(high), generator=gen).exp_().clamp_(min=floor)
        return dt + torch.log(-torch.expm1(-dt))  # softplus(this) == dt
    raise ValueError(f"unknown init rule {rule!r}")


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            # Every rank drew the same full tensor; keep this rank's slice, no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def init_parameters(model: nn.Module, seed: int, rule: InitRule, aliases: dict[str, str] | None = None) -> None:
    """Fill every parameter of `model` by `rule`, reproducibly from `seed`. `aliases` maps
    a parameter's name to the name it is drawn as (a pipeline stage's copy of a tied
    weight is drawn as the weight it copies, so both copies start equal)."""
    aliases = aliases or {}
    for name, param in named_unique_parameters(model):
        name = aliases.get(name, name)
        full = full_value(param.shape, rule(name), _generator(seed, name))
        _assign(param, full)
