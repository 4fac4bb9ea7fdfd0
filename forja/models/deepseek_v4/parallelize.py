"""How a DeepSeek-V4 model is spread over ranks under tensor parallelism: its plan, as data.

Attention (forja/models/common/compressed_attention.py) splits by query heads, as
DeepSeek-V3's latent attention does: the query latent (wq_a, q_norm) is small and stays whole
on every rank, wq_b is column-parallel (a rank's heads), and each head's sink goes with it.
The grouped low-rank output projection splits by groups: a rank's heads are whole groups
(parallel.tp divides o_groups and n_heads: the layout validator checks `split_counts`), so it
holds those groups' rows of wo_a and computes their low-rank outputs, and wo_b is
row-parallel over the groups' columns, summing the ranks' parts.

What every head reads stays whole on every rank, computed on the whole sequence:

- the one shared key/value head (wkv, kv_norm): a multi-query attention has no heads of it
  to split;
- the compressors: an entry mixes `ratio` consecutive tokens' projections, so it needs the
  whole sequence (a sequence split would cut windows), and every head attends to it;
- CSA's lightning indexer: it scores each entry by a weighted sum over all its own heads and
  then picks the top k, so a split of its heads would pick from partial scores; frozen (no
  gradient), every rank picks the same entries.

The key/value rows and entries reach each rank's heads only, so their gradient on a rank is
that rank's share: `SumGradients` on `attention.shared_kv` sums it over the ranks (DeepSeek-V3's
"f"), one (B, Tk + N, head_dim) all-reduce per layer, which then flows whole into wkv, kv_norm
and the compressors.

Every feed-forward is a mixture of experts, split by tokens as every MoE family's
(`SplitTokens`: the router and shared expert whole, the routed experts spread over the ranks by
forja.parallel.ep), its token ids split with the tokens for the hash-routed layers.

The hyper-connections (attn_hc, ffn_hc, hc_head) are tiny (2n + n^2 rows of n x dim) and work
token by token: whole on every rank. Without sequence parallelism they compute on the
replicated stream; with it the residual streams (B, T/tp, n, dim) between blocks are split
along the sequence, the hyper-connections compute on the rank's slice, and their gradients,
of the rank's tokens, are summed over the ranks (`LocalParameters` replicated), as the norms'
are (`SequenceParallel`). Attention gathers its input whole; the MoE layer takes its slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from forja.models.common.tp_plan import LocalParameters, SplitTokens, TPPlan, dense_tp_plan
from forja.models.deepseek_v3.parallelize import SumGradients
from forja.models.deepseek_v4.model import DeepSeekV4Args

_HC = ("fn", "base", "scale")  # a hyper-connection's parameters (forja/models/common/hyper_connections.py)


@dataclass
class DeepSeekV4TPPlan(TPPlan):
    """A TPPlan whose every block has its mixture of experts planned in `block` already (its
    token ids split with the tokens), so `block_plan` hands it out as it is."""

    def block_plan(self, moe: bool, kind: str = "full_attention") -> dict[str, ParallelStyle]:
        return self.block


def deepseek_v4_tp_plan(args: DeepSeekV4Args, sequence_parallel: bool) -> TPPlan:
    dense = dense_tp_plan(sequence_parallel, gated_mlp=False)
    seq = Shard(1) if sequence_parallel else Replicate()
    gather = None
    if sequence_parallel:
        # The block calls attention(x, rope, mask, cache, layer); x is gathered and handed over as
        # a plain tensor for the replicated query latent, key/value head, compressors and indexer.
        gather = PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                    desired_input_layouts=(Replicate(), None, None, None, None), use_local_output=True)
    block: dict[str, ParallelStyle] = {
        "attention": LocalParameters(("sinks",), then=gather),
        "attention.wq_b": ColwiseParallel(),
        "attention.shared_kv": SumGradients(),
        "attention.wo": LocalParameters(("wo_a",)),  # this rank's groups' rows (groups are contiguous)
        "attention.wo.wo_b": RowwiseParallel(output_layouts=seq),
        "feed_forward": SplitTokens(sequence_parallel, token_ids=True),
    }
    root = dict(dense.root)
    if sequence_parallel:
        block.update({norm: dense.block[norm] for norm in ("attention_norm", "ffn_norm")})
        block.update({hc: LocalParameters((), replicated=_HC) for hc in ("attn_hc", "ffn_hc")})
        root["hc_head"] = LocalParameters((), replicated=_HC)
    return DeepSeekV4TPPlan(root, block, sequence_parallel)
