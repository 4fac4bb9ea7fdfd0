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

A block with experts keeps its dense MLP split as above and runs its mixture of experts as
the other families' (`SplitTokens`: each rank routes a slice of the tokens, its experts spread
over the ranks by forja.parallel.ep, its experts' input norm whole on each rank as the other
parts of a mixture are); the router's norm scale and per-expert scales, which the router uses
directly, stay whole on every rank with their gradients, of the rank's tokens, summed over the
group (`LocalParameters`). The two norms on the dense and expert outputs compute where
post_ffn_norm does.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, RowwiseParallel, SequenceParallel

from forja.models.common.tp_plan import LocalParameters, TPPlan
from forja.models.gemma3.parallelize import gemma3_tp_plan
from forja.models.gemma4.model import Gemma4Args

# The router's parameters it uses by itself, not through a module SplitTokens distributes (the
# experts' input norm is one: a child of the mixture, computing on the rank's token rows).
_MOE_SCALES = ("router.norm.weight", "router.per_expert_scale")


class Gemma4TPPlan(TPPlan):
    """Gemma 3's plan; a block with experts runs them as any mixture (`feed_forward`), the
    router's own scales kept whole, and splits the dense MLP beside them (`mlp`) as a dense
    block's feed_forward."""

    def block_plan(self, moe: bool, kind: str = "full_attention") -> dict[str, ParallelStyle]:
        plan = super().block_plan(moe, kind)
        if moe:
            plan["feed_forward"] = LocalParameters((), then=plan["feed_forward"], replicated=_MOE_SCALES)
            plan |= {"mlp" + k.removeprefix("feed_forward"): v for k, v in self.block.items()
                     if k.split(".")[0] == "feed_forward"}
            if self.sequence_parallel:  # on the rank's slice of the sequence, as post_ffn_norm
                plan["post_mlp_norm"] = plan["post_moe_norm"] = SequenceParallel(use_local_output=True)
        return plan


def gemma4_tp_plan(args: Gemma4Args, sequence_parallel: bool) -> TPPlan:
    base = gemma3_tp_plan(args, sequence_parallel)
    plan = Gemma4TPPlan(base.root, base.block, base.sequence_parallel, base.float8, base.mixers)
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
