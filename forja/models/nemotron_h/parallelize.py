"""How a Nemotron-H model is spread over ranks under tensor parallelism: its plan, as data.

Each block holds one sublayer, so each kind of block has its own plan (`NemotronHTPPlan`):

- attention blocks: q, k, v column-parallel by head, o row-parallel (the dense decoder's);
- MLP blocks: w1 column-parallel, w2 row-parallel (the dense decoder's MLP without a gate);
- MoE blocks: each rank routes and computes its slice of the tokens (`SplitTokens`, as every
  MoE family's), the router and shared expert whole on every rank, and so are latent experts'
  projections to and from the latent (plain Linears outside the experts, their gradients summed
  over the ranks' tokens); the routed experts are spread over the ranks by forja.parallel.ep,
  which moves their latent-width rows;
- Mamba-2 blocks split by whole groups (tp must divide mamba_n_groups, which the layout
  validator checks through `head_counts`): z, x, B, C and dt projections column-parallel, so a
  rank holds its groups' B and C and the heads that read them; its share of the convolutions'
  channels, of A_log, D and dt_bias, and of the gated norm's weight (each norm group lies whole
  on one rank, so the grouped norm is exact); the output projection row-parallel.

Under sequence parallelism each block's norm computes on the rank's slice of the sequence and
the sublayer gathers it first, as the dense decoder's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from forja.models.common.tp_plan import LocalParameters, SplitTokens, TPPlan, dense_tp_plan
from forja.models.nemotron_h.model import NemotronHArgs

_MAMBA_LOCAL = ("A_log", "D", "dt_bias", "norm.weight", *(f"conv_{c}.{p}" for c in "xBC" for p in ("weight", "bias")))


@dataclass
class NemotronHTPPlan(TPPlan):
    """A TPPlan whose blocks' plans follow their kind alone (`kinds`: kind -> plan)."""

    kinds: dict[str, dict[str, ParallelStyle]] | None = None

    def block_plan(self, moe: bool, kind: str = "full_attention") -> dict[str, ParallelStyle]:
        return self.kinds[kind]


def nemotron_h_tp_plan(args: NemotronHArgs, sequence_parallel: bool) -> TPPlan:
    dense = dense_tp_plan(sequence_parallel, gated_mlp=False)
    seq = Shard(1) if sequence_parallel else Replicate()

    def of(prefix: str, norm: str) -> dict[str, ParallelStyle]:
        return {k: v for k, v in dense.block.items() if k.startswith(prefix) or k == norm}

    attention, mlp = of("attention", "attention_norm"), of("feed_forward", "ffn_norm")
    moe = {k: v for k, v in mlp.items() if not k.startswith("feed_forward")}
    moe["feed_forward"] = SplitTokens(sequence_parallel)
    mamba = {k: v for k, v in attention.items() if not k.startswith("attention.") and k != "attention"}
    mamba.update({f"attention.{n}": ColwiseParallel() for n in ("wz", "wx", "wB", "wC", "wdt")})
    mamba["attention.wo"] = RowwiseParallel(output_layouts=seq)
    # (absent conv biases are skipped); under SP the gather before the mixer is kept
    mamba["attention"] = LocalParameters(_MAMBA_LOCAL, then=attention.get("attention"))
    return NemotronHTPPlan(dense.root, attention, sequence_parallel,
                           kinds={"full_attention": attention, "mlp": mlp, "mamba2": mamba, "moe": moe})
