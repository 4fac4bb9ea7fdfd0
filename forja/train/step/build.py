"""The one place an engine is chosen for a layout: StepEngine (engine.py), or PipelineEngine
(pipelined.py) when the parts are pipeline stages."""

from __future__ import annotations

import torch

from forja.models.common.transformer import Transformer
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.parallel import ParallelDims
from forja.parallel.pp import Pipeline
from forja.train.step.engine import StepEngine, compute_dtype
from forja.train.step.groups import ReplicaGroups
from forja.train.step.pipelined import PipelineEngine
from forja.train.step.scaler import LossScaler


def build_engine(parts: list[Transformer], pipeline: Pipeline | None, optimizers: OptimizerGroup,
                 scheduler: SchedulerGroup, dims: ParallelDims, *, device: torch.device, precision: str,
                 grad_clip: float, document_mask: bool, scaler: LossScaler | None = None,
                 replicas: ReplicaGroups | None = None, grad_sync: str = "micro-batch") -> StepEngine:
    """The engine for this layout: a pipeline's when the parts are pipeline stages. `scaler`
    scales the loss (train.precision = "fp16"); `replicas` averages over torchft replica groups."""
    kwargs = dict(device=device, compute_dtype=compute_dtype(precision, device), grad_clip=grad_clip,
                  document_mask=document_mask, scaler=scaler, replicas=replicas)
    if pipeline is None:
        return StepEngine(parts, optimizers, scheduler, dims, grad_sync=grad_sync, **kwargs)
    return PipelineEngine(parts, optimizers, scheduler, dims, pipeline=pipeline, **kwargs)
