"""DeepSeek-V3.2's tensor-parallel plan: DeepSeek-V3's (forja/models/deepseek_v3/parallelize.py),
latent attention split by heads. The lightning indexer is replicated: every rank computes it
whole on the gathered input (its projections are small, 1-2% of a block) and so selects the
same keys for its heads. Its training loss is refused under TP by the preflight (the args'
`layout_limits`): the target is the attention summed over all heads, of which a rank holds a
share. The plan itself is made whatever the stage: the planner counts parameters through it."""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan
from forja.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from forja.models.deepseek_v32.model import DeepSeekV32Args


def deepseek_v32_tp_plan(args: DeepSeekV32Args, sequence_parallel: bool) -> TPPlan:
    return deepseek_v3_tp_plan(args, sequence_parallel)
