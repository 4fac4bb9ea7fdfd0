"""Parallelism: one build order for every layout, written down once here.

    meta device -> float8 Linear layers -> tensor/sequence parallel -> activation
    checkpointing -> torch.compile per block -> FSDP -> to_empty(device) -> init_weights(seed)
    (or load weights)

The family's `parallelize` function applies the middle steps in that order; building
on the meta device first means no rank ever holds the whole unsharded model, and
initializing last (from per-parameter seeded generators) gives the same weights
whatever the layout.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from forja.models import build_from_args, get_family
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims


@dataclass
class ParallelModel:
    """What one rank holds of the model."""

    parts: list[Transformer]
    """This rank's model parts: the whole model, or its pipeline stages (several for
    interleaved and V-shaped schedules). Parameter names are those of the whole model."""
    pipeline: Any = None
    """The pipeline schedule that runs the parts (forja/parallel/pp.py), when pp > 1."""


def parallelize(model: Transformer, family: str, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    module_name, func = get_family(family).parallelize.split(":")
    getattr(importlib.import_module(module_name), func)(model, dims, mesh, cfg)


def _materialize(part: Transformer, device: torch.device, seed: int,
                 load_weights: Callable[[Transformer], None] | None) -> None:
    part.to_empty(device=device)
    if not any(isinstance(p, torch.distributed.tensor.DTensor) for p in part.parameters()):
        part.tie_weights()  # to_empty unties plain modules; FSDP keeps one sharded parameter
    if load_weights is None:
        part.init_weights(seed)
    else:
        load_weights(part)


def build_parallel_model(args: TransformerArgs, family: str, *, dims: ParallelDims, mesh: DeviceMesh,
                         cfg: ParallelConfig, device: torch.device, seed: int,
                         load_weights: Callable[[Transformer], None] | None = None,
                         microbatch_size: int = 1, seq_len: int = 0, float8: str = "none",
                         float8_min_features: int = 1024) -> ParallelModel:
    """This rank's model, parallelized, with weights from `seed` or from `load_weights`."""
    model = build_from_args(args, device="meta")
    if float8 != "none":
        from forja.ops.float8 import apply_float8

        apply_float8(model, float8, device=device, min_features=float8_min_features)
    if dims.pp == 1:
        parallelize(model, family, dims, mesh, cfg)
        _materialize(model, device, seed, load_weights)
        return ParallelModel([model])
    from forja.parallel.pp import build_pipeline

    def prepare(part: Transformer) -> None:
        parallelize(part, family, dims, mesh, cfg)
        _materialize(part, device, seed, load_weights)

    return build_pipeline(model, dims=dims, mesh=mesh, cfg=cfg, device=device, prepare=prepare,
                          microbatch_size=microbatch_size, seq_len=seq_len)
