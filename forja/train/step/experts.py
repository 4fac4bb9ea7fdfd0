"""What the step engine does for a mixture of experts around each step.

Before the forward passes, every MoE layer learns its micro-batch's share of the step's
loss, the scale its auxiliary losses (load balancing, z-loss) enter the gradients with: the
same 1/n the cross-entropy of each of n micro-batches gets, on whichever pipeline stage
the layer lives. After the optimizer step, the layers' token counts are summed over the
ranks that saw different data, the auxiliary-loss-free bias takes its step (identically
on every rank), and the step's expert-load metrics are made:

    moe/load_max_mean   the busiest expert's load over the mean load (1 is balanced), worst layer
    moe/load_cv         coefficient of variation of the load over experts, mean over layers
    moe/dropped         share of token-slots dropped by the capacity limit
    moe/aux_loss, moe/z_loss   mean over layers and micro-batches, unweighted
    moe/layer{i}/...    the same per layer

Under pipeline parallelism each stage holds some layers; the metrics of all stages are
gathered so that rank 0 logs every layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forja.models.common.moe import MoEArgs, moe_layers
from forja.models.common.transformer import Transformer
from forja.parallel import ParallelDims


class ExpertBalance:
    """The MoE layers of this rank's model parts, and their per-step bookkeeping."""

    def __init__(self, parts: list[Transformer], dims: ParallelDims, device: torch.device):
        self.layers = sorted((i, m) for part in parts for i, m in moe_layers(part))
        self.dims, self.device = dims, device
        # The same on every rank (a pipeline stage may hold only dense layers).
        args = parts[0].args
        self.enabled = isinstance(args, MoEArgs) and args.n_experts > 0

    def begin_step(self, n_microbatches: int, loss_scale: float = 1.0) -> None:
        """`loss_scale`: fp16's loss scale (forja/train/step/scaler.py), which multiplies every loss term alike."""
        for _, moe in self.layers:
            moe.aux_loss_scale = loss_scale / n_microbatches

    def end_step(self, stepped: bool) -> dict[str, float]:
        """Sum the step's counts over data-parallel ranks, move the biases (if the optimizer
        stepped), and return the step's metrics (all layers of the model)."""
        if not self.enabled:
            return {}
        stats = [moe.take_stats() for _, moe in self.layers]
        counts, scalars = self._summed(stats)
        if stepped:
            for (_, moe), load in zip(self.layers, counts):
                moe.router.update_bias(load)
        per_layer = {i: _layer_metrics(load, row) for (i, _), load, row in zip(self.layers, counts, scalars)}
        if self.dims.pp_group is not None:
            gathered: list[dict] = [{}] * self.dims.pp
            dist.all_gather_object(gathered, per_layer, group=self.dims.pp_group)
            per_layer = {i: m for stage in gathered for i, m in stage.items()}
        return _summary(per_layer)

    def _summed(self, stats) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, E) routed token-slots per expert and (L, 4) [dropped, aux, z, forwards] of this
        rank's layers, summed over the ranks that saw different data."""
        if not stats:
            return torch.zeros(0, 0), torch.zeros(0, 4)
        E = self.layers[0][1].args.n_experts
        counts = torch.stack([s.tokens_per_expert if s.tokens_per_expert is not None
                              else torch.zeros(E, dtype=torch.float64, device=self.device) for s in stats])
        scalars = torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float64, device=counts.device)
                                            for v in (s.dropped, s.aux_loss, s.z_loss, s.forwards)])
                               for s in stats])  # (L, 4), built on the device: no sync per value
        packed = torch.cat([counts, scalars], dim=1)  # one collective for both
        group = self.dims.loss_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(packed, group=group)
        return packed[:, :E].cpu(), packed[:, E:].cpu()


def _layer_metrics(load: torch.Tensor, row: torch.Tensor) -> dict[str, float]:
    dropped, aux, z, forwards = row.tolist()
    mean = load.mean()
    return {
        "load_max_mean": float(load.max() / mean) if mean > 0 else 0.0,
        "load_cv": float(load.std(correction=0) / mean) if mean > 0 else 0.0,
        "dropped": dropped / max(float(load.sum()), 1.0),
        "aux_loss": aux / max(forwards, 1.0),
        "z_loss": z / max(forwards, 1.0),
    }


def _summary(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    if not per_layer:
        return {}
    rows = list(per_layer.values())
    out = {
        "moe/load_max_mean": max(r["load_max_mean"] for r in rows),
        "moe/load_cv": sum(r["load_cv"] for r in rows) / len(rows),
        "moe/dropped": sum(r["dropped"] for r in rows) / len(rows),
        "moe/aux_loss": sum(r["aux_loss"] for r in rows) / len(rows),
        "moe/z_loss": sum(r["z_loss"] for r in rows) / len(rows),
    }
    for i in sorted(per_layer):
        out.update({f"moe/layer{i}/{k}": v for k, v in per_layer[i].items()})
    return out
