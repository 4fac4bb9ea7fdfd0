"""Name-and-layout rules between forja and Hugging Face state dicts.

A family's adapter lists `TensorRule`s: one Hugging Face tensor <-> one or more forja
tensors, with the transforms between layouts (GPT-2's Conv1D weights are transposed;
its fused q/k/v projection is split in three). `{i}` in a name stands for a layer
index. The generic loader in `forja/models/hf.py` uses these rules both ways and to
say, for a bad checkpoint, which Hugging Face tensor is missing, extra or misshapen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def _one(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ts[0]


@dataclass(frozen=True)
class TensorRule:
    hf: str
    """Hugging Face name, e.g. "model.layers.{i}.self_attn.q_proj.weight"."""
    forja: tuple[str, ...]
    """forja name(s) the tensor becomes, e.g. ("layers.{i}.attention.wq.weight",)."""
    to_forja: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = field(default=lambda t: (t,))
    """Hugging Face tensor -> forja tensors (same order as `forja`)."""
    to_hf: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] = field(default=_one)
    """forja tensors -> Hugging Face tensor."""
    optional: bool = False
    """May be absent from a checkpoint (a tied lm_head)."""

    def expand(self, n_layers: int) -> list[TensorRule]:
        if "{i}" not in self.hf:
            return [self]
        return [TensorRule(self.hf.format(i=i), tuple(f.format(i=i) for f in self.forja),
                           self.to_forja, self.to_hf, self.optional) for i in range(n_layers)]


def transposed(t: torch.Tensor) -> tuple[torch.Tensor]:
    """Conv1D (in, out) -> Linear (out, in)."""
    return (t.t().contiguous(),)


def untransposed(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ts[0].t().contiguous()


def split3(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPT-2's fused c_attn: a (in, 3*out) weight or (3*out,) bias -> q, k, v in Linear layout."""
    if t.dim() == 1:
        return tuple(p.contiguous() for p in t.chunk(3))
    return tuple(p.t().contiguous() for p in t.chunk(3, dim=1))


def join3(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if ts[0].dim() == 1:
        return torch.cat(ts)
    return torch.cat([t.t() for t in ts], dim=1).contiguous()


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face conversion: the functions forja/models/hf.py calls."""

    architectures: tuple[str, ...]
    """`architectures` entries of config.json this family reads ("LlamaForCausalLM")."""
    args_from_config: Callable[[dict], Any]
    """config.json -> the family's typed args; refuses what forja cannot represent."""
    config_from_args: Callable[[Any], dict]
    """Typed args -> config.json; refuses models transformers has no equivalent for."""
    rules: Callable[[Any], list[TensorRule]]
    """The tensor rules for a model of these args."""
    ignored: tuple[str, ...] = ()
    """Patterns of stored tensors forja does not need (old causal-mask buffers)."""
    normalize_name: Callable[[str], str] = str
    """A stored tensor's name as the rules spell it (adds a missing prefix, say)."""
