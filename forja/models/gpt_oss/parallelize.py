"""How a gpt-oss model is spread over ranks under tensor parallelism: its plan, as data.

Its attention is the dense decoder's of forja/models/common/tp_plan.py: column-parallel q,
k, v (their biases split with their output columns), row-parallel o (its bias added once,
after the partial sums are reduced). The sinks, one logit per query head, are sharded with
the heads (`shard_attention_sinks`). Every block's feed-forward is a mixture of experts,
split by tokens over the TP ranks with its experts (biases included) spread over them
(`TPPlan.block_plan`), so the plan's gated-MLP entries are never used by a gpt-oss block.
"""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan, dense_tp_plan, shard_attention_sinks
from forja.models.gpt_oss.model import GptOssArgs


def gpt_oss_tp_plan(args: GptOssArgs, sequence_parallel: bool) -> TPPlan:
    plan = dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
    return shard_attention_sinks(plan) if args.attention_sinks else plan
