"""What the step engine does for a mixture of experts around each step (a step hook).

Before the forward passes the engine sets the step context's auxiliary-loss share
(forja/models/common/step_context.py): every MoE layer's auxiliary losses (load balancing,
z-loss) enter the gradients with the same 1/n the cross-entropy of each of n micro-batches
gets, on whichever pipeline stage the layer lives. After the backward passes this hook lays
the layers' counts out over the whole model, one row per layer (zeros for layers another
pipeline stage holds), and records them to be summed over the ranks that saw different data
and over the stages. After the optimizer step the auxiliary-loss-free bias takes its step from
the summed counts (identically on every rank, on the device), and the step's expert-load
metrics are made from the sums the step's one host sync brought:

    moe/load_max_mean   the busiest expert's load over the mean load (1 is balanced), worst layer
    moe/load_cv         coefficient of variation of the load over experts, mean over layers
    moe/dropped         share of token-slots dropped by the capacity limit
    moe/aux_loss, moe/z_loss   mean over layers and micro-batches, unweighted
    moe/layer{i}/...    the same per layer

so that every rank, rank 0 included, logs every layer of the model.
"""

from __future__ import annotations

import math

import torch

from forja import metric_names as names
from forja.models.common.moe import MoEArgs, MoEStats, moe_layers
from forja.models.common.transformer import Transformer
from forja.train.step.hooks import Reduce, StepDone, StepHook, Tally

# A layer's row after its E counts: dropped slots, aux-loss sum, z-loss sum, forwards, held.
_SCALARS = 5


class ExpertBalance(StepHook):
    """The MoE layers of this rank's model parts, and their per-step bookkeeping."""

    def __init__(self, parts: list[Transformer], device: torch.device):
        self.layers = sorted((i, m) for part in parts for i, m in moe_layers(part))
        self.device = device
        # The same on every rank (a pipeline stage may hold only dense layers).
        args = parts[0].args
        self.enabled = isinstance(args, MoEArgs) and args.n_experts > 0
        self.n_experts = args.n_experts if self.enabled else 0
        self.rows = args.n_layers + args.mtp_depth  # every block index of the whole model
        self._table = None

    def record(self, tally: Tally) -> None:
        """(rows, E + 5) float64: each held layer's routed token-slots per expert, then dropped,
        aux, z, forwards and 1 (held); zeros for other layers. Summed over data ranks and stages."""
        E = self.n_experts
        table = torch.zeros(self.rows, E + _SCALARS, dtype=torch.float64, device=self.device)
        for i, moe in self.layers:
            table[i] = _row(moe.take_stats(), E, self.device)
        self._table = tally.add(table, Reduce.SUM)

    def end(self, done: StepDone) -> dict[str, float]:
        """Move the biases (if the optimizer stepped) by the summed counts; the step's metrics
        (all layers of the model)."""
        table, E = self._table, self.n_experts
        if done.stepped:
            for i, moe in self.layers:
                moe.router.update_bias(table.device[i, :E])  # (E,) on the device: no sync
        width = E + _SCALARS
        rows = (table.host[i * width:(i + 1) * width] for i in range(self.rows))
        return _summary({i: _layer_figures(row, E) for i, row in enumerate(rows) if row[-1] > 0})


def _row(stats: MoEStats, E: int, device: torch.device) -> torch.Tensor:
    """One layer's (E + 5,) float64 row, built on the device: no sync per value."""
    counts = stats.tokens_per_expert if stats.tokens_per_expert is not None \
        else torch.zeros(E, dtype=torch.float64, device=device)
    scalars = [torch.as_tensor(v, dtype=torch.float64, device=device) if isinstance(v, torch.Tensor)
               else torch.full((), float(v), dtype=torch.float64, device=device)  # a fill: no host-to-device copy
               for v in (stats.dropped, stats.aux_loss, stats.z_loss, stats.forwards, 1.0)]
    return torch.cat([counts.to(torch.float64), torch.stack(scalars)])


def _layer_figures(row: list[float], E: int) -> dict[str, float]:
    """One layer's figures from its summed row, on the host in float64 as torch computes them on
    the CPU (a 1-D tensor's std is two-pass: its mean, then the squared deviations added in order),
    so that they are the same to the last bit on any device."""
    load, (dropped, aux, z, forwards) = row[:E], row[E:E + 4]
    total = sum(load)  # counts are whole numbers: any order adds them exactly
    mean = total / E
    squares = 0.0
    for count in load:
        squares += (count - mean) * (count - mean)
    return {
        "load_max_mean": max(load) / mean if mean > 0 else 0.0,
        "load_cv": math.sqrt(squares / E) / mean if mean > 0 else 0.0,
        "dropped": dropped / max(total, 1.0),
        "aux_loss": aux / max(forwards, 1.0),
        "z_loss": z / max(forwards, 1.0),
    }


def _summary(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    if not per_layer:
        return {}
    rows = list(per_layer.values())
    out = {
        names.MOE_LOAD_MAX_MEAN: max(r["load_max_mean"] for r in rows),
        names.MOE_LOAD_CV: sum(r["load_cv"] for r in rows) / len(rows),
        names.MOE_DROPPED: sum(r["dropped"] for r in rows) / len(rows),
        names.MOE_AUX_LOSS: sum(r["aux_loss"] for r in rows) / len(rows),
        names.MOE_Z_LOSS: sum(r["z_loss"] for r in rows) / len(rows),
    }
    for i in sorted(per_layer):
        out.update({names.moe_layer(i, k): v for k, v in per_layer[i].items()})
    return out
