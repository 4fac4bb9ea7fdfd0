"""How a Qwen3.5 model is spread over ranks under tensor parallelism: its plan, as data.

The attention blocks are the dense decoder of forja/models/common/tp_plan.py with QK-norm,
plus the output gate `wg`, column-parallel like the query it gates (each rank gates the
heads it holds). Mixture-of-experts feed-forwards are split by tokens (`TPPlan.block_plan`).
Gated DeltaNet blocks are split by head (`gated_deltanet_tp_plan`): tp must divide the key
heads, which forja's one layout validator checks (TransformerArgs.split_counts).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel

from forja.models.common.tp_plan import TPPlan, dense_tp_plan, gated_deltanet_tp_plan
from forja.models.qwen3_5.model import Qwen3_5Args


def qwen3_5_tp_plan(args: Qwen3_5Args, sequence_parallel: bool) -> TPPlan:
    plan = dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
    plan.block["attention.wg"] = ColwiseParallel()  # its input is gathered like the query's
    return gated_deltanet_tp_plan(plan)
