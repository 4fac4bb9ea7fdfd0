"""Adafactor (Shazeer & Stern 2018) as torch ships it, and under FSDP and TP too.

`torch.optim.Adafactor` computes its factored second moment with in-place reductions that
DTensor cannot run on a shard (a column mean of a row-sharded matrix is a partial sum). So
when the parameters are DTensors, each step gathers a parameter and its gradient, runs
torch's single-tensor update on the whole matrix (the same formulas, written out in `_update`
and checked against torch's in the tests), and keeps this rank's shard of the result. The
row/column statistics are small (rows + columns) and kept whole on every rank, in torch's own
state layout, so a checkpoint resumes on any layout. Plain tensors take torch's own step.

The gather costs one all-gather of each parameter and gradient per step: correct and simple,
not yet as lean as statistics reduced across shards (left for when Adafactor runs at scale).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from forja.optim.closure import closure_loss


class Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose step also runs on DTensor (FSDP/TP-sharded) parameters."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict) -> None:
        sharded = isinstance(p, DTensor)
        full = p.full_tensor() if sharded else p
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        state = self.state[p]
        if not state:  # torch's layout: a step counter and factored (or full, for vectors) statistics
            state["step"] = torch.tensor(0.0)
            if grad.dim() > 1:
                state["row_var"] = grad.new_zeros(grad.shape[:-1]).unsqueeze(-1)
                state["col_var"] = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:]).unsqueeze(-2)
            else:
                state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        _update(full, -grad if group["maximize"] else grad, state, lr=float(group["lr"]), d=group["d"],
                beta2_decay=group["beta2_decay"], weight_decay=group["weight_decay"], eps1=group["eps"][0],
                eps2=group["eps"][1])
        if sharded:  # keep this rank's shard of the updated whole (every rank holds the same whole)
            mine = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(mine.to_local())


def _update(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, d: float, beta2_decay: float,
            weight_decay: float, eps1: float | None, eps2: float) -> None:
    """One Adafactor step of a whole tensor, in place: torch's single-tensor formulas."""
    eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
    state["step"] += 1
    step = state["step"].item()
    one_minus_beta2 = step**beta2_decay
    alpha = max(eps2, param.norm(2).item() / param.numel() ** 0.5) * min(lr, 1 / step**0.5)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        row_var, col_var = state["row_var"], state["col_var"]
        row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), one_minus_beta2)
        col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)), one_minus_beta2)
        estimate = (row_var @ col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        state["variance"].lerp_(grad * grad, one_minus_beta2)
        estimate = state["variance"].clone()
    update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
    denom = max(1.0, update.norm(2).item() / (update.numel() ** 0.5 * d))
    param.add_(update, alpha=-alpha / denom)
