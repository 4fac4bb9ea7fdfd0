"""How a Qwen3 model is spread over ranks under tensor parallelism: its plan, as data.

Qwen3 is the dense decoder of forja/models/common/tp_plan.py (column-parallel q/k/v and
gate/up, row-parallel o and down) with QK-norm, whose per-head norms keep their weights
replicated with the gradients summed over the TP group (see `dense_tp_plan`).
Mixture-of-experts blocks (Qwen3-MoE) share the attention part of this plan; their MoE layer
is split by tokens over the TP ranks, its experts spread over them (`TPPlan.block_plan`).
"""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.qwen3.model import Qwen3Args


def qwen3_tp_plan(args: Qwen3Args, sequence_parallel: bool) -> TPPlan:
    return dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
