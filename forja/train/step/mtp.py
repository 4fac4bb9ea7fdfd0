"""What the step engine does for multi-token prediction (forja/models/common/mtp.py) around each step.

Before the forward passes, the modules learn the scale their weighted loss enters the
gradients with: the micro-batch's share of the step (1/n of n micro-batches, times fp16's
loss scale), as the cross-entropy and a mixture of experts' auxiliary losses get it
(forja/train/step/experts.py). After the step, each depth's loss is averaged over the step's
micro-batches and the data-parallel ranks:

    mtp/loss_{k}   depth k's mean cross-entropy (predicting t_{i+k+1}), unweighted

The reported `loss` stays the main next-token loss: the MTP losses enter its backward only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forja.models.common.mtp import mtp_modules
from forja.models.common.transformer import Transformer
from forja.parallel import ParallelDims


class MTPLosses:
    """The multi-token prediction modules of this rank's model parts, and their per-step metrics."""

    def __init__(self, parts: list[Transformer], dims: ParallelDims, device: torch.device):
        self.modules = [m for part in parts for m in mtp_modules(part)]
        self.depth = parts[0].args.mtp_depth if parts else 0  # every pp rank's, modules or not
        self.dims, self.device = dims, device

    def begin_step(self, n_microbatches: int, loss_scale: float = 1.0) -> None:
        for module in self.modules:
            module.loss_scale = loss_scale / n_microbatches

    def end_step(self) -> dict[str, float]:
        """Each depth's mean loss over this step's forwards and the data-parallel ranks, on
        every rank: under a pipeline only the last stage runs the modules, and passes them on."""
        if not self.depth:
            return {}
        means = torch.zeros(self.depth, device=self.device)  # (depth,)
        for module in self.modules:  # one per rank: the last stage's (a V schedule's rank 0 has it once)
            stats = module.take_stats()
            if stats.forwards:
                means = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                                     for v in stats.losses]) / stats.forwards
        if self.dims.pp > 1:
            dist.all_reduce(means, group=self.dims.pp_group)  # the last stage's values, zeros elsewhere
        elif not self.modules:
            return {}
        group = self.dims.loss_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(means, group=group)
            means /= dist.get_world_size(group)
        return {f"mtp/loss_{k}": v for k, v in enumerate(means.tolist(), start=1)}
