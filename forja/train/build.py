"""The one build order of a model, written down once, for every layout:

    build on the meta device -> float8 Linear layers -> [cut into pipeline stages] ->
    for each part: tensor/sequence parallel -> activation checkpointing -> torch.compile
    per block -> FSDP  (forja.parallel.parallelize) -> to_empty(device) ->
    init_weights(seed), or load weights

Building on the meta device first means no rank ever holds the whole unsharded model;
initializing last, from per-parameter seeded generators, gives the same weights whatever
the layout (a pipeline stage's copy of a tied embedding included). A part whose
parameters FSDP offloads is materialized on the CPU, where FSDP expects them.

The rest of a run's pieces (data, optimizer, engine, checkpoints) are built by the
trainer's `setup`, which reads as the list of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from forja.models import build_from_args, spec_of
from forja.models.common.transformer import Transformer, TransformerArgs
from forja.ops.float8 import apply_float8
from forja.parallel import ParallelConfig, ParallelDims, parallelize
from forja.parallel.pp import Pipeline, build_pipeline


@dataclass
class ModelParts:
    """What one rank holds of the model."""

    parts: list[Transformer]
    """The whole model, or this rank's pipeline stages (several for interleaved and
    V-shaped schedules). Parameter names are those of the whole model."""
    pipeline: Pipeline | None = None
    """The pipeline that runs the parts, when parallel.pp > 1."""


def build_model_parts(args: TransformerArgs, dims: ParallelDims, cfg: ParallelConfig, *, device: torch.device,
                      seed: int, load_weights: Callable[[Transformer], None] | None = None, seq_len: int = 0,
                      float8: str = "none", float8_min_features: int = 1024,
                      materialize_in: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                      ) -> ModelParts:
    """This rank's model, parallelized, with weights from `seed` or from `load_weights`.
    `materialize_in`: the mode the weights are made under (a rehearsal's fake tensors,
    forja/train/rehearse/); the build before it runs on the meta device either way."""
    model = build_from_args(args, device="meta")
    plan = spec_of(args).tp_plan(args, cfg.sequence_parallel and dims.tp > 1)
    if float8 != "none":
        # Before TP, so that the plan's styles for the converted layers are torchao's float8 ones.
        apply_float8(model, float8, device=device, min_features=float8_min_features)
        plan = dataclasses.replace(plan, float8=True)

    def prepare(part: Transformer) -> None:
        parallelize(part, plan, dims, cfg, device)
        with materialize_in():
            _materialize(part, torch.device("cpu") if cfg.cpu_offload else device, seed, load_weights)

    if dims.pp == 1:
        prepare(model)
        return ModelParts([model])
    pipeline = build_pipeline(model, dims=dims, cfg=cfg, device=device, prepare=prepare, seq_len=seq_len)
    return ModelParts(pipeline.parts, pipeline)


def _materialize(part: Transformer, device: torch.device, seed: int,
                 load_weights: Callable[[Transformer], None] | None) -> None:
    part.to_empty(device=device)
    if not any(isinstance(p, DTensor) for p in part.parameters()):
        part.tie_weights()  # to_empty unties plain modules; FSDP and TP keep one parameter
    if load_weights is None:
        part.init_weights(seed)
    else:
        load_weights(part)
