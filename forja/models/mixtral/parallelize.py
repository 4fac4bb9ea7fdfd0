"""How a Mixtral model is spread over ranks under tensor parallelism: its plan, as data.

Its attention is the dense decoder's of forja/models/common/tp_plan.py (column-parallel
q/k/v, row-parallel o; no QK-norm). Every block's feed-forward is a mixture of experts,
split by tokens over the TP ranks with its experts spread over them (`TPPlan.block_plan`),
so the plan's gated-MLP entries are never used by a Mixtral block.
"""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.mixtral.model import MixtralArgs


def mixtral_tp_plan(args: MixtralArgs, sequence_parallel: bool) -> TPPlan:
    return dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
