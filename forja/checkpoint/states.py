"""The `Stateful` pieces a checkpoint holds besides the data loader.

DCP calls `state_dict()` when saving and `load_state_dict()` after loading in place,
so each piece decides how it is represented. Model and optimizer go through
`torch.distributed.checkpoint.state_dict`, which turns FSDP/TP-sharded parameters into
DTensors DCP can reshard onto another layout.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


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
    """The loop's position: optimizer steps done, tokens trained on, steps skipped."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skipped_steps = int(state["skipped_steps"])
