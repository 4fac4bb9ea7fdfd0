"""Applying a layout to a model (or one pipeline stage), in the order it must happen:

    tensor/sequence parallel (the family's plan) -> expert parallel -> activation
    checkpointing -> torch.compile per block -> FSDP

Each step wraps what the previous one made: checkpointing wraps the TP-converted blocks,
compile traces the checkpointed blocks, and FSDP's per-block units go around the
compiled ones, so its all-gathers stay outside the compiled graphs. The model is still
on the meta device here; forja/train/build.py writes down the whole build order around
this step (meta model, float8, this, then materialization and initialization).
"""

from __future__ import annotations

import torch

from forja.models.common.tp_plan import TPPlan
from forja.models.common.transformer import Transformer
from forja.parallel.ac import apply_ac
from forja.parallel.compile import apply_compile
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims
from forja.parallel.ep import apply_ep, expert_layout
from forja.parallel.fsdp import apply_fsdp, wants_fsdp
from forja.parallel.regather import regathers
from forja.parallel.tp import apply_tp, enable_async_tp, regather_sequence_inputs, wait_for_embedding_output


def parallelize(model: Transformer, plan: TPPlan, dims: ParallelDims, cfg: ParallelConfig,
                device: torch.device) -> None:
    """Spread `model` (a whole model or a pipeline stage, on the meta device) over this
    rank's share of `dims`, in place."""
    if dims.tp > 1:
        apply_tp(model, dims.tp_mesh, plan)
        if cfg.compile:
            wait_for_embedding_output(model)
        if cfg.async_tp:
            enable_async_tp(dims.tp_mesh)
    experts = expert_layout(dims)  # under TP too: its ranks split an MoE layer's tokens
    if experts is not None:
        apply_ep(model, *experts)
    apply_ac(model, cfg)
    if regathers(cfg, tp=dims.tp, sequence_parallel=plan.sequence_parallel, float8=plan.float8):
        regather_sequence_inputs(model, dims.tp_mesh, plan, compiled=cfg.compile)
    if cfg.compile:
        apply_compile(model, cfg.compile_backend)
    if wants_fsdp(dims, cfg):
        apply_fsdp(model, dims, cfg, device)
