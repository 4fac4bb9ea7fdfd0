"""How a Kimi Linear model is spread over ranks under tensor parallelism: its plan, as data.

Latent-attention blocks and dense MLPs take DeepSeek-V3's plan (forja/models/deepseek_v3/
parallelize.py: heads split, the latents whole on every rank, the shared key head's gradient
summed); mixtures of experts are split by tokens (`TPPlan.block_plan`). KDA blocks are split
by head, as Gated DeltaNet's: column-parallel q, k, v, beta and the second halves of the
low-rank decay and output-gate projections (wf_b, wg_b: a rank keeps its heads' channels),
the rank-d first halves (wf_a, wg_a) whole on every rank (their input gradients are summed
by the column-parallel layers after them), each rank's share of the convolutions' channels,
of A_log and of dt_bias, the row-parallel output projection summing the heads' parts; the
output norm's (d,) weight is shared by all heads: replicated, its gradient summed.
"""

from __future__ import annotations

from forja.models.common.tp_plan import TPPlan, gated_deltanet_tp_plan
from forja.models.deepseek_v3.parallelize import deepseek_v3_tp_plan
from forja.models.kimi_linear.model import KimiLinearArgs


def kimi_linear_tp_plan(args: KimiLinearArgs, sequence_parallel: bool) -> TPPlan:
    # DeepSeek-V3's plan (it reads q_lora_rank only) with the KDA blocks split by head as Gated
    # DeltaNet's, their projections named as Kimi's (the gates' low-rank second factors split).
    return gated_deltanet_tp_plan(deepseek_v3_tp_plan(args, sequence_parallel),
                                  projections=("wq", "wk", "wv", "wb", "wf_b", "wg_b"))
