"""How a GPT-2 model is spread over ranks under tensor parallelism: its plan, as data.

GPT-2's module names match the dense plan's, with two differences: the MLP has no gate
(w3), and learned positions are added to the embedding's output. So with sequence
parallelism the embedding returns the whole sequence, the positions are added to it, and
the first block takes its own slice of the sequence.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.gpt2.model import GPT2Args


def gpt2_tp_plan(args: GPT2Args, sequence_parallel: bool) -> TPPlan:
    plan = dense_tp_plan(sequence_parallel, gated_mlp=False)
    if sequence_parallel:
        plan.root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        # The block is called as block(x, rope, mask, cache, layer): only x is split.
        rest = (None,) * 4
        plan.root["layers.0"] = PrepareModuleInput(input_layouts=(Replicate(), *rest),
                                                   desired_input_layouts=(Shard(1), *rest), use_local_output=True)
    return plan
