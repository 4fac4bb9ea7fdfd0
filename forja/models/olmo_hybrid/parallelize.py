"""How an OLMo-Hybrid model is spread over ranks under tensor parallelism: its plan, as data.

The two kinds of block take two plans (`TPPlan.mixers`):

- attention blocks are OLMo 3's post-norm blocks with QK-norm over all heads, so theirs is
  OLMo 3's plan (forja/models/olmo3/parallelize.py): q/k/v column-parallel with their outputs
  gathered (the norm needs every head), the output projection row-parallel on its replicated
  input, the MLP the dense decoder's;
- Gated DeltaNet blocks split their mixer by head (`gated_deltanet_tp_plan`: tp must divide
  the linear key heads, which the layout validator checks through `split_counts`), and are
  pre-norm: under sequence parallelism their attention_norm and ffn_norm compute on the
  rank's slice of the sequence, as the dense decoder's do.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from forja.models.common.tp_plan import TPPlan, gated_deltanet_tp_plan
from forja.models.olmo3.parallelize import olmo3_tp_plan
from forja.models.olmo_hybrid.model import OlmoHybridArgs


def olmo_hybrid_tp_plan(args: OlmoHybridArgs, sequence_parallel: bool) -> TPPlan:
    plan = gated_deltanet_tp_plan(olmo3_tp_plan(args, sequence_parallel))
    if sequence_parallel:  # the post-norms' styles name modules a pre-norm block lacks: unused there
        plan.mixers["linear_attention"].update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
    return plan
