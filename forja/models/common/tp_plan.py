"""The tensor-parallel plan of a dense decoder, written with torch's own parallel styles.

A plan is data: module names mapped to `torch.distributed.tensor.parallel` styles, one
dict for the model's own modules and one applied to every block. `forja.parallel`
applies it; nothing here touches a mesh or a process group, so model code stays
single-device and a family changes its plan by editing a dict.

Megatron-LM's scheme: column-parallel q, k, v, gate and up projections split the heads
and hidden columns; row-parallel o and down projections sum the partial results. With
sequence parallelism the residual stream and the norms between blocks hold (B, T/tp, dim)
per rank instead of the whole (B, T, dim) (Korthikanti et al. 2022), and each block
gathers the sequence before its projections. The output projection stays split over the
vocabulary: the loss runs vocabulary-parallel, so no rank holds the full logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)


@dataclass
class TPPlan:
    """Where each module goes under tensor parallelism."""

    root: dict[str, ParallelStyle]
    """The model's own modules (embeddings, final norm, output), by dotted name; names a
    pipeline stage lacks are skipped."""
    block: dict[str, ParallelStyle]
    """Every transformer block's modules, by name within the block."""
    sequence_parallel: bool
    """Whether the residual stream between blocks is split along the sequence."""

    def block_plan(self, moe: bool) -> dict[str, ParallelStyle]:
        """The plan of one block; `moe`: its feed-forward is a mixture of experts.

        An MoE layer is not split over the tensor-parallel ranks: each computes it whole for
        all tokens (its experts are spread by expert parallelism instead, whose groups lie
        across data-parallel ranks). Under sequence parallelism it receives the gathered
        sequence and hands back this rank's slice."""
        if not moe:
            return self.block
        plan = {k: v for k, v in self.block.items() if not k.startswith("feed_forward")}
        if self.sequence_parallel:
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        return plan


def dense_tp_plan(sequence_parallel: bool, *, gated_mlp: bool = True, qk_norm: bool = False) -> TPPlan:
    """The plan of a pre-norm block with attention (wq, wk, wv, wo) and an MLP (w1, w2, and
    the gate's w3 when `gated_mlp`); norms named attention_norm and ffn_norm; with `qk_norm`,
    per-head attention.q_norm and attention.k_norm."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Logits stay split over the vocabulary: the loss runs under loss_parallel().
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if gated_mlp:
        block["feed_forward.w3"] = ColwiseParallel()
    if qk_norm:
        # A rank holds whole heads, so the per-head norms compute on its local heads; but their
        # (head_dim,) weight's gradient sums over all heads. As "sequence parallel" along the
        # heads dimension of (B, T, heads, hd), the weight is a replicated DTensor whose partial
        # gradients are summed over the TP group; the output is handed back as a local tensor.
        for norm in ("attention.q_norm", "attention.k_norm"):
            block[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the projections: attention needs every position.
            # The block calls attention(x, rope, mask, cache, layer): only x is a DTensor.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return TPPlan(root, block, sequence_parallel)
