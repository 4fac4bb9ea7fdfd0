"""What the step engine does for multi-token prediction (forja/models/common/mtp.py) around each
step (a step hook).

Before the forward passes the engine sets the step context's auxiliary-loss share
(forja/models/common/step_context.py): the scale the modules' weighted loss enters the
gradients with, the micro-batch's share of the step (1/n of n micro-batches, times fp16's loss
scale), as the cross-entropy and a mixture of experts' auxiliary losses get it. After the
backward passes each depth's loss is averaged over the step's micro-batches here, and recorded
to be averaged over the data-parallel ranks (under a pipeline only the last stage runs the
modules; the others record zeros, and the stages' sum passes the values on):

    mtp/loss_{k}   depth k's mean cross-entropy (predicting t_{i+k+1}), unweighted

The reported `loss` stays the main next-token loss: the MTP losses enter its backward only.
"""

from __future__ import annotations

import torch

from forja import metric_names as names
from forja.models.common.mtp import mtp_modules
from forja.models.common.transformer import Transformer
from forja.train.step.hooks import Reduce, StepDone, StepHook, Tally


class MTPLosses(StepHook):
    """The multi-token prediction modules of this rank's model parts, and their per-step metrics."""

    def __init__(self, parts: list[Transformer], device: torch.device):
        self.modules = [m for part in parts for m in mtp_modules(part)]
        self.depth = parts[0].args.mtp_depth if parts else 0  # every pp rank's, modules or not
        self.enabled = self.depth > 0
        self.device = device
        self._means = None

    def record(self, tally: Tally) -> None:
        """Each depth's mean loss over this step's forwards (depth,) float32; zeros on a rank
        without the modules."""
        means = torch.zeros(self.depth, device=self.device)  # (depth,)
        for module in self.modules:  # one per rank: the last stage's (a V schedule's rank 0 has it once)
            stats = module.take_stats()
            if stats.forwards:
                means = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                                     for v in stats.losses]) / stats.forwards
        self._means = tally.add(means, Reduce.MEAN)

    def end(self, done: StepDone) -> dict[str, float]:
        return {names.mtp_loss(k): v for k, v in enumerate(self._means.host, start=1)}
