"""Name-and-layout rules between forja and Hugging Face state dicts.

A family's adapter lists `TensorRule`s: one Hugging Face tensor <-> one or more forja
tensors, with the transforms between layouts (GPT-2's Conv1D weights are transposed;
its fused q/k/v projection is split in three). `{i}` in a name stands for a layer
index. A rule may also map many Hugging Face tensors to slices of one forja tensor:
a mixture of experts holds one (E, H, D) tensor per projection where the published
checkpoints hold one (H, D) tensor per expert, so `{e}` in the name stands for the
slice along dim 0 (`stacked=E`), and each expert is streamed into, or cut from, its own
slice. The generic loader in `forja/models/hf.py` uses these rules both ways and to
say, for a bad checkpoint, which Hugging Face tensor is missing, extra or misshapen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    stacked: int = 0
    """Above 0: the forja tensors stack this many Hugging Face tensors along dim 0, the
    one `{e}` in `hf` names going to slice e ("mlp.experts.{e}.gate_proj.weight" is
    slice e of "feed_forward.experts.w1"). `expand` makes one rule per slice."""
    index: int | None = None
    """Set by `expand` on a stacked rule: the slice of the forja tensors this rule covers."""

    def expand(self, n_layers: int) -> list[TensorRule]:
        """One rule per layer for `{i}`, then one per slice for `{e}`: rules that each name
        one Hugging Face tensor."""
        rules = [self]
        if "{i}" in self.hf:
            # "{e}" is formatted as itself here, and replaced below.
            rules = [replace(self, hf=self.hf.format(i=i, e="{e}"), forja=tuple(f.format(i=i) for f in self.forja))
                     for i in range(n_layers)]
        if self.stacked:
            rules = [replace(r, hf=r.hf.replace("{e}", str(e)), stacked=0, index=e)
                     for r in rules for e in range(self.stacked)]
        return rules

    def forja_views(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forja tensors this (expanded) rule reads and writes, from a state dict by
        name: whole, or their slice `index` (a view, so copying into it fills the tensor)."""
        ts = tuple(tensors[n] for n in self.forja)
        return ts if self.index is None else tuple(t[self.index] for t in ts)


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
    """The tensor rules for a model of these args: the layout forja saves."""
    ignored: tuple[str, ...] = ()
    """Patterns of stored tensors forja does not need (old causal-mask buffers)."""
    normalize_name: Callable[[str], str] = str
    """A stored tensor's name as the rules spell it (adds a missing prefix, say)."""
    other_layouts: Callable[[Any], list[list[TensorRule]]] = lambda args: []
    """Further layouts a checkpoint may hold the same model in, each a full list of rules
    (transformers 5 can save experts fused into one tensor per layer). Loading follows
    whichever of `rules` and these names the most stored tensors; saving writes `rules`."""
    held_args: Callable[[Any, set[str]], Any] = lambda args, names: args
    """The args from config.json fitted to the stored tensor names before the layout is read
    (DeepSeek-V3: transformers writes num_nextn_predict_layers = 1 with no MTP tensors, so
    the count holds only when its modules are stored)."""


def decoder_config(a: Any) -> dict:
    """The config.json keys every rotary decoder family writes alike, from its args."""
    return {"hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.ffn_dim,
            "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
            "tie_word_embeddings": a.tie_embeddings}
