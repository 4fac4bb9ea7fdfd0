"""How a Gemma 4 text model is spread over ranks under tensor parallelism: its plan, as data.

Gemma 3's plan (forja/models/gemma3/parallelize.py): column-parallel q/k/v and gate/up,
row-parallel o and down, the per-head QK-norms' weights replicated with their gradients summed
over the TP group, the sandwich norms on whatever the row-parallel projections hand the
residual stream. A rank holds whole heads of every block, so a shared key/value block reads
its producer's keys and values for its own heads, and a global block with attention_k_eq_v
normalizes its rank's key heads into values.

The per-layer embedding table is split over the vocabulary like the token embedding, its
output replicated (or, under sequence parallelism, the rank's slice of the sequence). The
projection into per-layer inputs, their norm and each block's per-layer gate, projection and
norm work token by token: without sequence parallelism they stay plain modules on the
replicated stream; with it they are replicated DTensors computing on the rank's slice, their
gradients summed over the TP group (torch's `SequenceParallel` style, as the norms).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

from forja.models.common.tp_plan import TPPlan
from forja.models.gemma3.parallelize import gemma3_tp_plan
from forja.models.gemma4.model import Gemma4Args


def gemma4_tp_plan(args: Gemma4Args, sequence_parallel: bool) -> TPPlan:
    plan = gemma3_tp_plan(args, sequence_parallel)
    seq = Shard(1) if sequence_parallel else Replicate()
    if args.ple_dim:
        plan.root["ple_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if not sequence_parallel:
        return plan
    # The block calls attention(x, rope, mask, cache, layer, shared): only x is a DTensor.
    plan.block["attention"] = PrepareModuleInput(input_layouts=(Shard(1), *[None] * 5),
                                                 desired_input_layouts=(Replicate(), *[None] * 5))
    if args.ple_dim:
        for name in ("ple_projection", "ple_projection_norm"):
            plan.root[name] = SequenceParallel(use_local_output=True)
        for name in ("ple_gate", "ple_proj", "ple_norm"):
            plan.block[name] = SequenceParallel(use_local_output=True)
    return plan
