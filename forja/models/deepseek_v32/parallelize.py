"""DeepSeek-V3.2's tensor-parallel plan: DeepSeek-V3's (forja/models/deepseek_v3/parallelize.py),
latent attention split by heads. The lightning indexer is replicated: every rank computes it
whole on the gathered input (its projections are small, 1-2% of a block) and so selects the
same keys for its heads. Its training loss is refused under TP: the target is the attention
summed over all heads, of which a rank holds a share."""

from __future__ import annotations

from forja.errors import ForjaError
from forja.models.common.tp_plan import TPPlan
from forja.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from forja.models.deepseek_v32.model import DeepSeekV32Args


def deepseek_v32_tp_plan(args: DeepSeekV32Args, sequence_parallel: bool) -> TPPlan:
    if args.dsa_stage is not None:
        raise ForjaError(f"model.dsa_stage={args.dsa_stage!r} under tensor parallelism: the indexer's target sums "
                         "the attention of every head, which forja does not gather over TP ranks; train the "
                         "indexer with parallel.tp = 1")
    return deepseek_v3_tp_plan(args, sequence_parallel)
