"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

One state tensor per parameter (the momentum m), and an update that is a sign, so every
coordinate moves by exactly lr: per step,

    update = sign(beta1 * m + (1 - beta1) * g)
    p     <- p - lr * (update + weight_decay * p)      (decoupled decay)
    m     <- beta2 * m + (1 - beta2) * g

Every operation is elementwise, so FSDP2/TP shards (DTensors) are updated as they are:
each rank updates its own slice, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from forja.optim.closure import closure_loss


class Lion(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"Lion: lr = {lr} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas = {betas} must be two numbers in [0, 1)")
        if weight_decay < 0:
            raise ValueError(f"Lion: weight_decay = {weight_decay} must be >= 0")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                # lerp(m, g, 1 - beta1) = beta1 * m + (1 - beta1) * g, without a temporary for each term.
                update = torch.lerp(m, grad, 1 - beta1).sign_()
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
                m.lerp_(grad, 1 - beta2)
        return loss
