"""Parallelism: one build order for every layout, written down once here.

    meta device -> tensor/sequence parallel -> activation checkpointing -> torch.compile
    per block -> FSDP -> to_empty(device) -> init_weights(seed) (or load weights)

The family's `parallelize` function applies the middle steps in that order; building
on the meta device first means no rank ever holds the whole unsharded model, and
initializing last (from per-parameter seeded generators) gives the same weights
whatever the layout.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from forja.models import build_from_args, get_family
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims


def parallelize(model: Transformer, family: str, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    module_name, func = get_family(family).parallelize.split(":")
    getattr(importlib.import_module(module_name), func)(model, dims, mesh, cfg)


def build_parallel_model(args: TransformerArgs, family: str, *, dims: ParallelDims, mesh: DeviceMesh,
                         cfg: ParallelConfig, device: torch.device, seed: int,
                         load_weights: Callable[[Transformer], None] | None = None) -> Transformer:
    """The model of this rank, parallelized, with weights from `seed` or from `load_weights`."""
    model = build_from_args(args, device="meta")
    parallelize(model, family, dims, mesh, cfg)
    model.to_empty(device=device)
    if not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()):
        model.tie_weights()  # to_empty unties plain modules; FSDP keeps one sharded parameter
    if load_weights is None:
        model.init_weights(seed)
    else:
        load_weights(model)
    return model
