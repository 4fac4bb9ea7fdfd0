"""How a Gemma 3 text model is spread over ranks under tensor parallelism: its plan, as data.

The dense decoder of forja/models/common/tp_plan.py with per-head QK-norm (column-parallel
q/k/v and gate/up, row-parallel o and down; the QK-norms' weights replicated with their
gradients summed over the TP group), plus the two norms on the sublayers' outputs. Those
compute on whatever the row-parallel projection hands the residual stream: the whole
sequence, replicated, or under sequence parallelism the rank's slice of it, their weights
then replicated DTensors like the input norms'. The embedding's sqrt(dim) applies to the
rank's slice of the embedded sequence.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.gemma3.model import Gemma3Args


def gemma3_tp_plan(args: Gemma3Args, sequence_parallel: bool) -> TPPlan:
    plan = dense_tp_plan(sequence_parallel, gated_mlp=True, qk_norm=args.qk_norm)
    if sequence_parallel:
        # Local outputs: they are added to the residual stream, itself local tensors.
        plan.block["post_attention_norm"] = SequenceParallel(use_local_output=True)
        plan.block["post_ffn_norm"] = SequenceParallel(use_local_output=True)
    return plan
