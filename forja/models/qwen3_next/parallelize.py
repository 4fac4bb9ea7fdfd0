"""How a Qwen3-Next model is spread over ranks under tensor parallelism: Qwen3.5's plan
(forja/models/qwen3_5/parallelize.py), whose blocks are the same modules; its dense blocks
(`mlp_only_layers`) are the dense decoder's SwiGLU, which that plan already splits."""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan
from forja.models.qwen3_5.parallelize import qwen3_5_tp_plan
from forja.models.qwen3_next.model import Qwen3NextArgs


def qwen3_next_tp_plan(args: Qwen3NextArgs, sequence_parallel: bool) -> TPPlan:
    return qwen3_5_tp_plan(args, sequence_parallel)
