"""One optimizer step's forward and backward: accumulation, loss, clipping.

The loss of a step is the mean next-token cross-entropy over every token of the
global batch. Each micro-batch has the same number of tokens (packed sequences, no
padding), so each contributes its mean divided by the number of micro-batches, and
data-parallel gradient averaging (FSDP/DDP) turns the per-rank means into the global
mean: any layout computes the same loss and gradients as one process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from forja.parallel.cp import cp_context


@dataclass
class StepOutput:
    loss: float
    """Mean loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    """Tokens processed by all ranks this step."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _all_reduce_mean(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
        values /= dist.get_world_size(group)
    return values


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (possibly replicated DTensor) scalar."""
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def forward_backward(model: nn.Module, batches: Sequence, *, device: torch.device,
                     compute_dtype: torch.dtype | None, document_mask: bool,
                     loss_ctx=contextlib.nullcontext, cp_mesh=None) -> torch.Tensor:
    """Accumulate gradients over `batches`; returns this rank's mean loss (0-dim tensor).
    `loss_ctx()` wraps the loss and its backward (vocabulary-parallel loss under TP);
    `cp_mesh` splits each sequence over the context-parallel ranks."""
    total = torch.zeros((), device=device)
    for batch in batches:
        tokens = batch.input_ids.to(device, non_blocking=True)
        labels = batch.labels.to(device, non_blocking=True)
        doc_ids = batch.document_ids.to(device, non_blocking=True) if document_mask else None
        positions = torch.arange(tokens.shape[1], device=device)
        with cp_context(cp_mesh, tokens, labels, positions), loss_ctx():
            with autocast(device, compute_dtype):
                loss = model(tokens, doc_ids, positions=positions, labels=labels) / len(batches)
            loss.backward()
        total += local_value(loss.detach())
    return total


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by device mesh (plain tensors together): foreach kernels and
    DTensor reductions need a list of one kind. Under TP without FSDP, for instance,
    norm weights are plain tensors and projections DTensors."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.device_mesh if isinstance(p, torch.distributed.tensor.DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def clip_gradients(parts: Sequence[nn.Module], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the norm of all gradients of all parts, over all ranks, to `max_norm` (0: no
    clipping); returns the norm before clipping."""
    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    groups = _by_mesh(params)
    squares = []
    for group in groups:
        norm = nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        squares.append(local_value(norm) ** 2)  # a DTensor's norm is reduced over its mesh here
    total = torch.stack(squares).sum()
    if pp_group is not None:  # each pipeline rank holds other layers: add up their squares
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        for group in groups:
            nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def train_step(parts: Sequence[nn.Module], optimizers, batches: Sequence, *, device: torch.device,
               compute_dtype: torch.dtype | None, grad_clip: float, document_mask: bool,
               dp_group: dist.ProcessGroup | None, dp_size: int, pipeline=None,
               pp_group: dist.ProcessGroup | None = None, loss_ctx=contextlib.nullcontext,
               cp_mesh=None) -> StepOutput:
    """Forward, backward and clipping of one step. The optimizer step is the caller's,
    so a non-finite loss can be refused before it changes the weights."""
    optimizers.zero_grad(set_to_none=True)
    if pipeline is None:
        loss = forward_backward(parts[0], batches, device=device, compute_dtype=compute_dtype,
                                document_mask=document_mask, loss_ctx=loss_ctx, cp_mesh=cp_mesh)
    else:
        loss = pipeline.forward_backward(batches, device=device, compute_dtype=compute_dtype,
                                         document_mask=document_mask)
    norm = clip_gradients(parts, grad_clip, pp_group)
    loss = _all_reduce_mean(loss, dp_group)  # the norm is already global
    tokens = sum(b.input_ids.numel() for b in batches) * dp_size
    # The one host sync of the step: the loop needs the loss to decide on NaNs.
    loss_value, norm_value = torch.stack([loss, norm.to(loss.device, loss.dtype)]).tolist()
    return StepOutput(loss=loss_value, grad_norm=norm_value, tokens=tokens)
