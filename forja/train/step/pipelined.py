"""The step engine of a pipeline: this rank's stages, run by the schedule (forja/parallel/pp.py).

What differs from StepEngine (engine.py): the schedule runs the step's micro-batches through the
stages, each micro-batch's loss is composed by `_pipeline_loss`, validation and logits go
through the stages, and a tied embedding's two copies (first and last stage) are kept one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forja.models.common.transformer import Transformer
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.parallel import ParallelDims, local_value
from forja.parallel.pp import Pipeline
from forja.train.step.engine import StepEngine


class PipelineEngine(StepEngine):
    """Steps of this rank's pipeline stages, run by the schedule."""

    def __init__(self, parts: list[Transformer], optimizers: OptimizerGroup, scheduler: SchedulerGroup,
                 dims: ParallelDims, *, pipeline: Pipeline, **kwargs):
        super().__init__(parts, optimizers, scheduler, dims, **kwargs)
        self.pipeline = pipeline
        # The distinct Parameters holding a tied embedding here: the first stage's embedding
        # and the last stage's copy (both, on a V schedule's rank 0).
        held = {id(p): p for part in parts for name, p in part.named_parameters() if name in part.tied_parameters()}
        self._tied = list(held.values())
        if self.context is not None:  # each stage makes its micro-batch's part of the rows
            for part in parts:
                part.register_forward_pre_hook(self.context.stage_hook, with_kwargs=True)

    @property
    def model(self) -> Transformer | None:
        return None  # no rank holds every layer

    def forward_backward(self, batches: Sequence) -> torch.Tensor:
        inputs = [self._inputs(b) for b in batches]
        tokens = torch.cat([t for t, _, _ in inputs])  # (local batch, T)
        labels = torch.cat([y for _, y, _ in inputs])
        doc_ids = torch.cat([d for _, _, d in inputs]) if self.document_mask else None
        rows = None
        if self.context is not None:  # this rank's part of each row; the stages get the rows' documents
            tokens, labels, rows = self.context.split_rows(tokens, labels, doc_ids)
            doc_ids = None
        # The schedule interleaves forwards and backwards, so backwards run inside autocast too;
        # autograd gives each backward op its forward op's dtype either way.
        # The schedule keeps the loss function of its first step: the step's labels are read from here.
        self._step_labels = batches[0].step_labels if self._padded(batches) else 0
        with self.autocast(), self._loss_context():
            losses = self.pipeline.step(tokens, labels, doc_ids, n_batches=len(batches), loss_fn=self._pipeline_loss,
                                        cp_rows=rows)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # the last stage's; train_step's sum over the stages passes it on
            total += local_value(loss.detach())
        return total

    def _pipeline_loss(self, out: torch.Tensor, n: int, labels: torch.Tensor) -> torch.Tensor:
        """A schedule micro-batch's part of the step's loss: with padding, weighed by its labels."""
        if self._step_labels:
            out = out * self._label_share(labels, self._step_labels, n)
        return self.microbatch_loss(out, n)

    @torch.no_grad()
    def eval_loss(self, batch) -> torch.Tensor:
        """Mean loss of one micro-batch, forward through the stages, the same on every pp rank."""
        tokens, labels, doc_ids = self._inputs(batch)
        with self.autocast(), self._loss_context():
            loss = self.pipeline.forward(tokens, labels, doc_ids)
        value = local_value(loss) if loss is not None else torch.zeros((), device=self.device)
        return self.pipeline.from_last_stage(value.float())

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        return self.pipeline.forward(tokens, labels=None, document_ids=None)

    def sync_tied_copies(self) -> None:
        """Sum the gradients of a tied embedding's copies (first and last stage), so both
        copies take the same optimizer step and stay equal: together they get the gradient
        the one shared weight gets in the whole model."""
        held = [p for p in self._tied if p.grad is not None]
        if not held:
            return  # a middle stage, or an untied model
        for p in held:
            # TP leaves the embedding's gradient replicated; lay it out as the weight is, so
            # both ends hold the same shard (a local slice, no communication).
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in held]
        total = local[0]  # summed in place: no copy of an embedding-sized gradient per step
        for g in local[1:]:  # a V schedule's rank 0 holds both copies
            total.add_(g)
        if not self.pipeline.ends_on_one_rank:
            dist.all_reduce(total, group=self.dims.pp_ends_group)
        for g in local[1:]:
            g.copy_(total)
