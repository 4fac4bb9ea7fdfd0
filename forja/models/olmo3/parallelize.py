"""How an OLMo 3 model is spread over ranks under tensor parallelism: its plan, as data.

The MLP is the dense decoder's (column-parallel gate/up, row-parallel down). Attention is
not split by heads: OLMo 3's QK-norm takes one RMS over all heads' queries (and one over
all keys), which a rank holding a slice of the heads cannot compute. So the q/k/v
projections are column-parallel with their outputs gathered (every rank then holds all
heads, normalizes them exactly and runs the whole attention: tp times the attention work,
as transformers' own plan for OLMo 3 does), and the output projection is row-parallel on
its replicated input, each rank taking its slice of the heads locally. The QK-norms' and
post-norms' weights stay whole on every rank, whose gradients agree there.

Under sequence parallelism the post-norms compute on the rank's slice of the sequence
(their outputs join the split residual stream) and each sublayer gathers the sequence first.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.olmo3.model import Olmo3Args


def olmo3_tp_plan(args: Olmo3Args, sequence_parallel: bool) -> TPPlan:
    plan = dense_tp_plan(sequence_parallel, gated_mlp=True)
    seq = Shard(1) if sequence_parallel else Replicate()
    block = {k: v for k, v in plan.block.items() if k not in ("attention_norm", "ffn_norm")}
    for name in ("attention.wq", "attention.wk", "attention.wv"):
        block[name] = ColwiseParallel(output_layouts=Replicate())  # all heads, for the norm over them
    block["attention.wo"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if sequence_parallel:
        block["post_attention_norm"] = SequenceParallel(use_local_output=True)
        block["post_ffn_norm"] = SequenceParallel(use_local_output=True)
        # The block's input is the split residual stream itself (no norm before a sublayer).
        block["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                desired_input_layouts=(Replicate(), None, None, None, None))
        block["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return TPPlan(plan.root, block, sequence_parallel)
