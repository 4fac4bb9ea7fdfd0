"""Muon (Jordan et al. 2024): momentum, orthogonalized by Newton-Schulz, for hidden matrices.

For a matrix parameter W (m x n) with gradient G, one step is

    B <- momentum * B + (1 - momentum) * G          the momentum buffer (an EMA)
    U <- (1 - momentum) * G + momentum * B          nesterov; else U = B
    O <- NS(U / ||U||_F)                            ~ the orthogonal factor of U (U = P S Q^T -> P Q^T)
    W <- W * (1 - lr * weight_decay) - lr * scale(m, n) * O

NS is the quintic Newton-Schulz iteration X <- aX + (b A + c A^2) X with A = X X^T, run on
the wide orientation (m <= n, so A is the smaller Gram matrix). Its coefficients push every
singular value of X towards ~1 in a few steps without converging exactly, which is enough.
A 3-D parameter (a mixture of experts' stacked experts, (E, H, D)) is E matrices, each
orthogonalized on its own.

Every other parameter (embeddings, output projection, norms, biases, routers) belongs to a
group with `use_muon=False` and takes a plain AdamW step: one `torch.optim.Optimizer` holds
both, so checkpointing and the learning-rate schedule see an ordinary optimizer.

Distributed (FSDP, TP, EP): a parameter is a DTensor, its momentum buffer a DTensor of the
same layout (the momentum is elementwise, so it stays sharded). The orthogonalization needs
the whole matrix: the update is gathered over every mesh dimension but "ep" (experts on
different EP ranks are different matrices), one rank of the gathered group orthogonalizes it,
and a broadcast gives it to the others; the matrices of a step are dealt round-robin to the
ranks of their group, so each rank orthogonalizes about 1 / group-size of them. Each rank
then keeps its own shard of the result (a local slice: no communication).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

NS_EPS = 1e-7  # floor of ||U||_F: a zero update stays zero rather than dividing by zero
UPDATE_SCALES = ("rms_match", "spectral", "none")


def update_scale(mode: str, rows: int, cols: int) -> float:
    """The factor on the orthogonal update of a rows x cols matrix.

    rms_match: an orthogonal m x n matrix has RMS 1/sqrt(max(m, n)); 0.2 sqrt(max(m, n)) gives
    it AdamW's typical update RMS of ~0.2, so AdamW's lr and weight decay carry over (Liu et al.
    2025). spectral: sqrt(max(1, m/n)) keeps the update's spectral norm per input dimension
    fixed (Jordan). none: 1."""
    if mode == "rms_match":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "none":
        return 1.0
    raise ValueError(f"update_scale {mode!r} is not one of {', '.join(UPDATE_SCALES)}")


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, ...], steps: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The approximate orthogonal factor of each matrix of `update` ((m, n) or (E, m, n)),
    computed in `dtype` and returned in `update`'s dtype."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT  # (.., n, m): iterate on the wide side, the Gram matrix is the smaller one
    # Frobenius norm >= spectral norm: after this every singular value is <= 1, where NS converges.
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    # addmm / baddbmm: beta * input + alpha * (m1 @ m2) in one kernel.
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT  # (.., m, m)
        poly = mm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = mm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return (x.mT if tall else x).to(update.dtype)


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA: tensor cores, and NS only needs singular values driven into a band around
    1, which bf16 resolves. fp32 elsewhere: CPU bf16 matmuls are slow, and fp32 keeps runs on
    CPU comparable across layouts within fp32 rounding (the parity tests)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Muon(torch.optim.Optimizer):
    """Muon on the groups with `use_muon=True`, AdamW on the others.

    Group keys: lr, weight_decay, use_muon; Muon's momentum, nesterov, ns_steps,
    ns_coefficients, update_scale; AdamW's betas, eps. `ns_dtype` None: `default_ns_dtype`."""

    def __init__(self, params: Iterable, *, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_coefficients: tuple[float, ...] = (3.4445, -4.775, 2.0315),
                 update_scale: str = "rms_match", betas: tuple[float, ...] = (0.9, 0.95), eps: float = 1e-8,
                 ns_dtype: torch.dtype | None = None):
        if len(ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients {ns_coefficients} must be three numbers (a, b, c)")
        if update_scale not in UPDATE_SCALES:
            raise ValueError(f"update_scale {update_scale!r} is not one of {', '.join(UPDATE_SCALES)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, use_muon=True, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), update_scale=update_scale,
                        betas=tuple(betas), eps=eps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owners = _Owners()  # the same order on every rank that shares a mesh: same owners
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_step(param, group, owners)
                else:
                    self._adamw_step(param, group)
        return loss

    def _muon_step(self, param: torch.Tensor, group: dict, owners: _Owners) -> None:
        if param.dim() not in (2, 3):
            raise ValueError(f"Muon takes 2-D or 3-D parameters; got shape {tuple(param.shape)}")
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buf, grad, momentum = state["momentum_buffer"], param.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        dtype = self.ns_dtype or default_ns_dtype(param.device)

        def orthogonalize(full: torch.Tensor) -> torch.Tensor:
            return newton_schulz(full, group["ns_coefficients"], group["ns_steps"], dtype)

        if isinstance(update, DTensor):
            ortho = _orthogonalize_distributed(update, orthogonalize, owners)
        else:
            ortho = orthogonalize(update)
        rows, cols = param.shape[-2:]
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
        param.add_(ortho, alpha=-lr * update_scale(group["update_scale"], rows, cols))

    def _adamw_step(self, param: torch.Tensor, group: dict) -> None:
        """torch.optim.AdamW's step, written per parameter (the non-Muon parameters are the few
        vectors and embeddings: a per-tensor loop costs little)."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step, (beta1, beta2), lr, grad = state["step"].item(), group["betas"], group["lr"], param.grad
        param.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)


class _Owners:
    """Deals the matrices of one step round-robin to the ranks of the group that gathers them."""

    def __init__(self) -> None:
        self._next: dict[tuple, int] = {}

    def next(self, key: tuple, size: int) -> int:
        index = self._next.get(key, 0)
        self._next[key] = index + 1
        return index % size


def _orthogonalize_distributed(update: DTensor, orthogonalize: Callable[[torch.Tensor], torch.Tensor],
                               owners: _Owners) -> DTensor:
    """`orthogonalize` of the whole matrices of `update`, laid out as `update`.

    Gathers over every mesh dimension but "ep" (this rank's experts stay its own), lets one
    rank of that gathered group compute, broadcasts its result along each gathered dimension,
    and takes this rank's slice back (Replicate -> Shard is local)."""
    mesh = update.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    gathered = [i for i, name in enumerate(names) if name != "ep" and mesh.size(i) > 1]
    placements = [p if i not in gathered else Replicate() for i, p in enumerate(update.placements)]
    full = update.redistribute(mesh, placements).to_local()  # (m, n) or (E_local, m, n)
    sizes = [mesh.size(i) for i in gathered]
    owner = owners.next((id(mesh), tuple(gathered)), math.prod(sizes))
    coordinate = mesh.get_coordinate()
    owner_coords = _unravel(owner, sizes)
    mine = all(coordinate[d] == c for d, c in zip(gathered, owner_coords))
    # contiguous: a collective sends the storage as laid out, and NS returns tall matrices transposed.
    result = orthogonalize(full).contiguous() if mine or not gathered else torch.empty_like(full)
    _broadcast_from(result, mesh, gathered, owner_coords)
    if "ep" not in names:
        # Every rank holds the same whole matrix: keep this rank's slice, no communication.
        return distribute_tensor(result, mesh, update.placements, src_data_rank=None)
    whole = DTensor.from_local(result, mesh, placements, run_check=False)
    return whole.redistribute(mesh, update.placements)  # Replicate -> Shard: a local slice


def _unravel(index: int, sizes: list[int]) -> list[int]:
    coords = []
    for size in reversed(sizes):
        coords.append(index % size)
        index //= size
    return coords[::-1]


def _broadcast_from(tensor: torch.Tensor, mesh: DeviceMesh, dims: list[int], coords: list[int]) -> None:
    """Broadcast from the rank at `coords` (on mesh dimensions `dims`) to all of them, one
    dimension at a time, innermost first: after the broadcast along dimension d, every rank
    whose coordinates on the dimensions before d match the owner's holds the result."""
    for dim, coord in reversed(list(zip(dims, coords))):
        dist.broadcast(tensor, group=mesh.get_group(dim), group_src=coord)
