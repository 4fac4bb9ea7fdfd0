"""How an OLMo-Hybrid model is spread over ranks under tensor parallelism: its plan, as data.

The attention blocks are OLMo 3's post-norm blocks with QK-norm over all heads, so their
plan is OLMo 3's (forja/models/olmo3/parallelize.py): q/k/v column-parallel with their
outputs gathered (the norm needs every head), the output projection row-parallel on its
replicated input, the MLP the dense decoder's. Gated DeltaNet blocks are not split yet:
forja's one layout validator refuses tp > 1 for a model with linear-attention blocks
(forja/parallel/checks.py), so this plan only ever meets attention blocks.
"""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan
from forja.models.olmo3.parallelize import olmo3_tp_plan
from forja.models.olmo_hybrid.model import OlmoHybridArgs


def olmo_hybrid_tp_plan(args: OlmoHybridArgs, sequence_parallel: bool) -> TPPlan:
    return olmo3_tp_plan(args, sequence_parallel)
