"""The `Stateful` pieces a checkpoint holds besides the data loader.

DCP calls `state_dict()` when saving and `load_state_dict()` after loading in place,
so each piece decides how it is represented. Model and optimizer go through
`torch.distributed.checkpoint.state_dict`, which turns FSDP/TP-sharded parameters into
DTensors DCP can reshard onto another layout.

A tied embedding is stored once, as "tok_embeddings.weight", whatever the layout: the
whole model's `output.weight` (the same Parameter) is left out, and a last pipeline
stage's own copy of it is stored under the embedding's name. Both copies are equal (the
step engine keeps them so), so when two ranks write that name DCP keeps one, as it does
for any replicated tensor; on load each copy reads it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


def _parts(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def stored_names(part: nn.Module, *, distinct: bool = False) -> dict[str, str]:
    """{parameter name: the name it is stored under} for the parameters of `part` that
    are stored under another name (copies of a tied weight). With `distinct`, only those
    that are Parameters of their own (a stage's copy), not a second name of a shared one:
    an optimizer knows a shared Parameter by its first name only."""
    tied = getattr(part, "tied_parameters", dict)()
    own = {name for name, _ in part.named_parameters()} if distinct else set(tied)
    return {name: stored for name, stored in tied.items() if name != stored and name in own}


def _rename(state: dict, part: nn.Module, *, to_stored: bool, optimizer: bool = False) -> dict:
    """`state` (model or flattened optimizer keys) with `part`'s tied copies renamed to
    their stored names, or back. Optimizer keys read "state.<param>.<key>"."""
    out = dict(state)
    held = getattr(part, "tied_parameters", dict)()
    for name, stored in stored_names(part, distinct=optimizer).items():
        src, dst = (name, stored) if to_stored else (stored, name)
        for key in [k for k in state if _names_param(k, src)]:
            # Storing, the copy's own key goes; loading, the stored key stays only if the
            # part also holds that parameter (the whole model does, a last stage does not).
            value = out.pop(key) if to_stored or stored not in held else out[key]
            if not to_stored and isinstance(value, torch.Tensor):
                # A copy of its own: an optimizer adopts the tensors it loads, and two
                # optimizers sharing one exp_avg (a V schedule's rank 0) would update it twice.
                value = value.clone()
            out.setdefault(key.replace(src, dst, 1), value)
    return out


def _names_param(key: str, param: str) -> bool:
    return key == param or any(key.startswith(f"{p}.{param}.") for p in ("state", "param_groups"))


def with_tied_copies(part: nn.Module, state: dict, *, optimizer: bool = False) -> dict:
    """A whole model's state with `part`'s tied copies filled in from the stored name."""
    return _rename(state, part, to_stored=False, optimizer=optimizer)


class ModelState(Stateful):
    """The weights of one model, or of the parts (pipeline stages) this rank holds.

    Parameters keep their names in the whole model ("layers.7.attention.wq.weight"), so a
    checkpoint loads whatever the stages are cut like on the next launch."""

    def __init__(self, model: nn.Module | list[nn.Module]):
        self.parts = _parts(model)

    def state_dict(self) -> dict:
        merged: dict = {}
        for part in self.parts:
            for key, value in _rename(get_model_state_dict(part), part, to_stored=True).items():
                merged.setdefault(key, value)  # a rank holding both tied copies stores one
        return merged

    def load_state_dict(self, state: dict) -> None:
        # Each part takes its own keys out of the merged state.
        strict = len(self.parts) == 1
        for part in self.parts:
            set_model_state_dict(part, with_tied_copies(part, state), options=StateDictOptions(strict=strict))


# Flattened keys ("state.layers.0.attention.wq.weight.exp_avg") name every entry by the
# parameter it belongs to, so the states of several parts merge into one dict.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# What a parameter group is comes from the code and the config, not from training: its name
# (forja/optim: "matrices", "muon", ...: which schedule it follows) and which update it takes
# (Muon's `use_muon`, SOAP's `precondition`). Checkpoints leave these out and a load takes them
# from the live optimizer, so a checkpoint written before a group had one still loads.
_GROUP_KEYS = (".name", ".use_muon", ".precondition")


def _is_group_kind(key: str) -> bool:
    return key.startswith("param_groups.") and key.endswith(_GROUP_KEYS)


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module | list[nn.Module], optimizers: torch.optim.Optimizer | list):
        self.parts = _parts(model)
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def state_dict(self) -> dict:
        merged: dict = {}
        for part, opt in zip(self.parts, self.optimizers):
            state = get_optimizer_state_dict(part, opt, options=_FLAT)
            for key, value in _rename(state, part, to_stored=True, optimizer=True).items():
                if not _is_group_kind(key):
                    merged.setdefault(key, value)
        return merged

    def load_state_dict(self, state: dict) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            names = {k: v for k, v in get_optimizer_state_dict(part, opt, options=_FLAT).items() if _is_group_kind(k)}
            full = {**with_tied_copies(part, state, optimizer=True), **names}  # the groups keep their names
            set_optimizer_state_dict(part, opt, full, options=_FLAT)


class RNGState(Stateful):
    """This rank's random generators: torch (CPU and CUDA), numpy and Python's."""

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainerCounters(Stateful):
    """The loop's position: optimizer steps done, tokens trained on, steps skipped, and the
    seconds spent in the steps that made it (goodput's numerator: a step lost to a crash or a
    rollback is undone with the checkpoint that did not hold it)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    productive_s: float = 0.0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skipped_steps = int(state["skipped_steps"])
        self.productive_s = float(state.get("productive_s", 0.0))  # absent from checkpoints before it
