"""How a Llama model is spread over ranks under tensor parallelism: its plan, as data.

Llama is the dense decoder of forja/models/common/tp_plan.py as it stands (gated SwiGLU
MLP, rotary positions computed inside attention), so its plan is that one, with the
per-head norms of its optional QK-norm.
`forja.parallel` applies it (then activation checkpointing, compile and FSDP, in the
order forja/train/build.py writes down); pipeline stages are cut before that.
"""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.llama.model import LlamaArgs


def llama_tp_plan(args: LlamaArgs, sequence_parallel: bool) -> TPPlan:
    return dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
