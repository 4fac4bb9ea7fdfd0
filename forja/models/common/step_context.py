"""What the step engine tells a model's modules about the step in progress.

A mixture of experts' auxiliary losses and multi-token prediction's losses enter the
gradients with this micro-batch's share of the step's loss, and attention modules keep their
heads' max logits only when QK-clip or the attn/ metrics ask. Those are the step's business,
not the model's: the step engine (forja/train/step/engine.py) makes one `StepContext` when it
is built, hands it to every module that reads one (`share_context`), and changes its values
in place at each step. Outside an engine (a model built alone, a test, generation) every
module holds `OUTSIDE_A_STEP`: a share of 1 and no tracking.

Why a 0-dim tensor for the share: a compiled block reads a Python float as a constant and
guards on its value, so each new value (fp16's loss scale halves and doubles; the number of
micro-batches changes with a batch-size schedule) would compile the block again. A tensor is
an input of the compiled graph: filled with a new value, it costs no recompile. It is float64,
so that its value rounds to the auxiliary loss's dtype exactly as the Python float did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class StepContext:
    """The per-step values modules read; the fields are fixed, the share's value changes."""

    aux_loss_share: torch.Tensor | float = 1.0
    """The factor an auxiliary loss enters the gradients with: this micro-batch's share of the
    step's loss (1/n of n micro-batches, times fp16's loss scale). A 0-dim float64 tensor on the
    model's device under an engine (filled by `begin_step`), 1.0 outside one."""
    track_max_logit: bool = False
    """Attention modules keep each head's max logit of the training forwards (QK-clip, the attn/
    metrics: forja/models/common/max_logit.py); fixed for a run."""

    @classmethod
    def for_engine(cls, device: torch.device, *, track_max_logit: bool) -> StepContext:
        """A context whose share the engine sets each step."""
        return cls(aux_loss_share=torch.ones((), dtype=torch.float64, device=device), track_max_logit=track_max_logit)

    @torch.no_grad()
    def begin_step(self, share: float) -> None:
        """Set the auxiliary losses' share of the step about to run (in place: no recompile)."""
        if not isinstance(self.aux_loss_share, torch.Tensor):
            raise TypeError("StepContext.begin_step needs a context made by StepContext.for_engine")
        self.aux_loss_share.fill_(share)


OUTSIDE_A_STEP = StepContext()
"""The context of a module no engine has handed one: a share of 1, no max-logit tracking."""


def share_context(model: nn.Module, context: StepContext) -> None:
    """Hand `context` to every module of `model` that reads one (those with a `step_context`)."""
    for module in model.modules():
        if isinstance(getattr(module, "step_context", None), StepContext):
            module.step_context = context


def aux_loss_grad(share: torch.Tensor | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The gradient an auxiliary loss gets (0-dim, `dtype`): its share of the step's loss. A fresh
    tensor, never the context's own, which autograd may accumulate into."""
    if isinstance(share, torch.Tensor):
        return share.to(device=device, dtype=dtype, copy=True)
    return torch.full((), share, dtype=dtype, device=device)


class AddAuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; backward gives `aux` (0-dim) the gradient `scale`, as if
    `scale * aux` had been added to the loss (Megatron-LM's MoEAuxLossAutoScaler idea).
    `scale` is a float or a 0-dim tensor (the step context's share: read at backward)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, aux_loss_grad(ctx.scale, ctx.aux_dtype, grad.device), None
