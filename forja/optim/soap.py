"""SOAP (Vyas et al. 2024, arXiv 2409.11321, "SOAP: Improving and Stabilizing Shampoo
using Adam"): Adam run in the eigenbasis of Shampoo's preconditioner.

For a matrix parameter W (m x n) with gradient G, per step t (Algorithm 3 of the paper):

    M  <- beta1 * M + (1 - beta1) * G                           (first moment, original basis)
    G' =  Q_L^T G Q_R,   M' = Q_L^T M Q_R                        (rotated)
    V' <- beta2 * V' + (1 - beta2) * G' * G'                    (second moment, rotated basis)
    N  =  Q_L [ (M' / (1 - beta1^t)) / (sqrt(V' / (1 - beta2^t)) + eps) ] Q_R^T
    W  <- W - lr * (N + weight_decay * W)                       (decoupled decay)
    L  <- shampoo_beta * L + (1 - shampoo_beta) * G G^T          (m x m)
    R  <- shampoo_beta * R + (1 - shampoo_beta) * G^T G          (n x n)
    if (t - 1) % precondition_frequency == 0: refresh Q_L, Q_R, the eigenbases of L, R

Choices (where the paper leaves room):
- Q_L, Q_R start as the identity, so step 1 is a plain Adam step; the bases are first
  computed at its end (the paper's code spends step 1 on initialization, moving nothing).
  Not rotating step 1's G by its own singular vectors matters: that G' is diagonal, and
  Adam would blow its rounding-noise off-diagonal up to +-1.
- The first refresh is an exact `eigh`; later ones are one power iteration and a QR, as in
  the paper: Q <- QR(P Q), with Q's columns first sorted by their estimated eigenvalues
  diag(Q^T P Q), descending, and V' permuted with them (so each V' entry follows its
  eigenvector; QR keeps column order, and simultaneous iteration converges to sorted order).
- M is kept in the original basis (as in Algorithm 3), so a basis change needs no re-projection
  of it; V' is kept as is across a refresh, as in the paper.
- A parameter with 3+ dimensions is viewed as 2-D by merging its leading dimensions
  ((a, b, c) -> (a*b, c)); a dimension above max_precond_dim gets the identity (no factor,
  no rotation on that side; the reference's cap); 1-D parameters (norms, biases) get plain Adam.
- Embeddings, the output projection and MoE routers get plain Adam too (groups with
  `precondition=False`, from forja.optim.params, the rule Muon follows): the usual practice, and
  a vocabulary side under the cap would otherwise cost a vocab x vocab factor and its `eigh`
  (8,192^2 on the default recipe: a 119 s first step on a CPU, bench/RESULTS.md).

State per preconditioned matrix (fp32): M and V' (2 x mn), L and Q_L (2 x m^2), R and Q_R (2 x n^2).

DTensor parameters (FSDP2/TP shards): the rotation needs the whole matrix, so the gradient
is gathered (`full_tensor()`), the state is kept whole (identical on every rank, stored as
plain tensors, which a checkpoint treats as replicated), and each rank applies its own
slice of the update (`distribute_tensor(..., src_data_rank=None)`: no communication, since
every rank holds the same full update). Correct, not memory-efficient: every rank holds the
full state of every matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from forja.optim.closure import closure_loss


class Soap(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, shampoo_beta: float = 0.95,
                 precondition_frequency: int = 10, max_precond_dim: int = 10_000):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"SOAP: lr = {lr}, eps = {eps}, weight_decay = {weight_decay} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas) or not 0.0 <= shampoo_beta < 1.0:
            raise ValueError(f"SOAP: betas = {betas} and shampoo_beta = {shampoo_beta} must be in [0, 1)")
        if precondition_frequency < 1 or max_precond_dim < 1:
            raise ValueError("SOAP: precondition_frequency and max_precond_dim must be >= 1")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "shampoo_beta": shampoo_beta, "precondition_frequency": precondition_frequency,
                    "max_precond_dim": max_precond_dim, "precondition": True}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() >= 2 and group["precondition"]:
                    self._matrix_step(p, group)
                else:
                    self._adam_step(p, group)
        return loss

    def _adam_step(self, p: torch.Tensor, group: dict) -> None:
        """Plain Adam (decoupled decay) on a 1-D parameter or a group with `precondition=False`
        (embeddings, output, routers: forja.optim.params): elementwise, DTensors as they are."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = int(state["step"].item())
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(p.grad, 1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        _apply(p, (m / (1 - beta1**t)).div_(denom), group)

    def _matrix_step(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        g = grad.float().reshape(-1, grad.shape[-1])  # (m, n): leading dims merged
        rows, cols = g.shape
        state = self.state[p]
        if not state:
            _init_matrix_state(state, rows, cols, g.device, group["max_precond_dim"])
        state["step"] += 1
        t = int(state["step"].item())
        beta1, beta2 = group["betas"]
        sb = group["shampoo_beta"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - beta1)
        g_rot = _rotate(g, state.get("Q_L"), state.get("Q_R"))  # (m, n)
        v.mul_(beta2).addcmul_(g_rot, g_rot, value=1 - beta2)
        m_rot = _rotate(m, state.get("Q_L"), state.get("Q_R"))
        n_rot = (m_rot / (1 - beta1**t)).div_((v / (1 - beta2**t)).sqrt_().add_(group["eps"]))
        update = _rotate_back(n_rot, state.get("Q_L"), state.get("Q_R")).reshape(grad.shape).to(p.dtype)
        if isinstance(p, DTensor):
            # Every rank holds the same full update: each keeps its slice, no communication.
            update = distribute_tensor(update, p.device_mesh, p.placements, src_data_rank=None)
        _apply(p, update, group)
        # The bases for the next steps, from the factors including this step's G.
        if "L" in state:
            state["L"].lerp_(g @ g.T, 1 - sb)  # (m, m)
        if "R" in state:
            state["R"].lerp_(g.T @ g, 1 - sb)  # (n, n)
        if (t - 1) % group["precondition_frequency"] == 0:
            _refresh_bases(state, first=(t == 1))


def _apply(p: torch.Tensor, update: torch.Tensor, group: dict) -> None:
    """p <- p - lr * (update + weight_decay * p)."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0:
        p.mul_(1 - lr * wd)
    p.add_(update, alpha=-lr)


def _init_matrix_state(state: dict, rows: int, cols: int, device: torch.device, max_dim: int) -> None:
    state["step"] = torch.tensor(0.0)
    state["exp_avg"] = torch.zeros(rows, cols, device=device)  # M, original basis
    state["exp_avg_sq"] = torch.zeros(rows, cols, device=device)  # V', rotated basis
    # A side above max_precond_dim has no factor: its rotation is the identity.
    if rows <= max_dim:
        state["L"] = torch.zeros(rows, rows, device=device)
        state["Q_L"] = torch.eye(rows, device=device)
    if cols <= max_dim:
        state["R"] = torch.zeros(cols, cols, device=device)
        state["Q_R"] = torch.eye(cols, device=device)


def _rotate(x: torch.Tensor, q_l: torch.Tensor | None, q_r: torch.Tensor | None) -> torch.Tensor:
    """Q_L^T x Q_R (a missing Q is the identity)."""
    if q_l is not None:
        x = q_l.T @ x
    if q_r is not None:
        x = x @ q_r
    return x


def _rotate_back(x: torch.Tensor, q_l: torch.Tensor | None, q_r: torch.Tensor | None) -> torch.Tensor:
    """Q_L x Q_R^T (a missing Q is the identity)."""
    if q_l is not None:
        x = q_l @ x
    if q_r is not None:
        x = x @ q_r.T
    return x


def _refresh_bases(state: dict, *, first: bool) -> None:
    for side, dim in (("L", 0), ("R", 1)):
        if side not in state:
            continue
        factor = state[side]
        if first:
            state[f"Q_{side}"] = eigenbasis(factor)
        else:
            q, order = power_iteration(factor, state[f"Q_{side}"])
            state[f"Q_{side}"] = q
            # V' entries follow their eigenvectors: rows (L) or columns (R) of V' permute with Q.
            state["exp_avg_sq"] = state["exp_avg_sq"].index_select(dim, order)


def eigenbasis(factor: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric PSD factor, by descending eigenvalue (columns)."""
    # A tiny ridge keeps eigh stable on a rank-deficient factor (G G^T of one step is rank <= n).
    jitter = 1e-30 * torch.eye(factor.shape[0], device=factor.device, dtype=factor.dtype)
    _, vectors = torch.linalg.eigh(factor + jitter)
    return vectors.flip(1)


def power_iteration(factor: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of simultaneous iteration toward the eigenbasis of `factor`, starting from q:
    q's columns sorted by estimated eigenvalue diag(q^T P q), descending, then QR(P q).
    Returns the new basis and the sort order (to permute what lives in the old basis)."""
    estimates = (q.T @ factor @ q).diagonal()
    order = torch.argsort(estimates, descending=True, stable=True)
    q_new, _ = torch.linalg.qr(factor @ q[:, order])
    return q_new, order
