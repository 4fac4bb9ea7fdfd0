"""Muon (Jordan et al. 2024): momentum, orthogonalized by Newton-Schulz, for hidden matrices.

For a matrix parameter W (m x n) with gradient G, one step is

    B <- momentum * B + (1 - momentum) * G          the momentum buffer (an EMA)
    U <- (1 - momentum) * G + momentum * B          nesterov; else U = B
    O <- NS(U / ||U||_F)                            ~ the orthogonal factor of U (U = P S Q^T -> P Q^T)
    W <- W * (1 - lr * weight_decay) - lr * scale(m, n) * O

NS is the quintic Newton-Schulz iteration X <- aX + (b A + c A^2) X with A = X X^T, run on
the wide orientation (m <= n, so A is the smaller Gram matrix). Its coefficients push every
singular value of X towards ~1 in a few steps without converging exactly, which is enough.
`orthogonalizer = "polar_express"` takes a different (a, b, c) at each step instead (Amsel et
al. 2025, arXiv:2505.16932: each step's quintic is the minimax-optimal one for the interval
the singular values are in by then, so the small ones rise faster early and all settle closer
to 1), on X scaled by 1.02 ||X||_F, the margin its coefficients were derived with.

`cautious_weight_decay` decays a coordinate only where the update moves it the way the decay
would (sign(O) = sign(W)): elsewhere the update already pulls it in, and the decay would
fight it (Chen et al. 2025, "Cautious weight decay").
A 3-D parameter (a mixture of experts' stacked experts, (E, H, D)) is E matrices, each
orthogonalized on its own.

Every other parameter (embeddings, output projection, norms, biases, routers) belongs to a
group with `use_muon=False` and takes a plain AdamW step: one `torch.optim.Optimizer` holds
both, so checkpointing and the learning-rate schedule see an ordinary optimizer.

Distributed (FSDP, TP, EP): a parameter is a DTensor, its momentum buffer a DTensor of the
same layout (the momentum is elementwise, so it stays sharded). The orthogonalization needs
whole matrices: each matrix of a step has one owner among the ranks of its mesh, balanced by
size; the blocks of the matrices travel to their owners only, in buckets of
`bucket_bytes` (one all_to_all a bucket), each owner orthogonalizes its matrices, and a
second all_to_all returns each rank its block of each result (forja/optim/exchange.py). A
rank that holds a matrix whole (an expert, under expert parallelism) orthogonalizes it where
it is. `NS_COUNT` counts this rank's Newton-Schulz calls and matrices, for tests and benches.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forja.optim.closure import closure_loss
from forja.optim.exchange import Layouts, Unit, buckets, exchange_bucket, mesh_group, plan_units

NS_EPS = 1e-7  # floor of ||U||_F: a zero update stays zero rather than dividing by zero
UPDATE_SCALES = ("rms_match", "spectral", "none")
ORTHOGONALIZERS = ("newton_schulz", "polar_express")
# Polar Express's five steps for Muon (arXiv:2505.16932, its coefficients with a 2% safety
# margin, as modded-nanogpt's records use them): a later step reuses the last one.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_EXPRESS_MARGIN = 1.02  # X / (1.02 ||X||_F): the spectral bound its first step assumes, with room
BUCKET_BYTES = 64 * 2**20  # a bucket's matrices, whole: a few collectives a step, bounded memory
NS_COUNT: Counter = Counter()  # this rank's Newton-Schulz work: "calls", "matrices"


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
                  dtype: torch.dtype, orthogonalizer: str = "newton_schulz") -> torch.Tensor:
    """The approximate orthogonal factor of each matrix of `update` ((m, n) or (E, m, n)),
    computed in `dtype` and returned in `update`'s dtype: `coefficients` at every step, or
    Polar Express's own per step (module docstring)."""
    if orthogonalizer == "polar_express":
        schedule, margin = [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)], POLAR_EXPRESS_MARGIN
    else:
        schedule, margin = [tuple(coefficients)] * steps, 1.0
    NS_COUNT["calls"] += 1
    NS_COUNT["matrices"] += update.numel() // max(update.shape[-2] * update.shape[-1], 1)
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT  # (.., n, m): iterate on the wide side, the Gram matrix is the smaller one
    # Frobenius norm >= spectral norm: after this every singular value is <= 1, where NS converges.
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * margin).clamp(min=NS_EPS)
    # addmm / baddbmm: beta * input + alpha * (m1 @ m2) in one kernel.
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in schedule:
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
    ns_coefficients, update_scale; AdamW's betas, eps. `ns_dtype` None: `default_ns_dtype`.
    `bucket_bytes`: the whole matrices one exchange of a distributed step moves, at most about."""

    def __init__(self, params: Iterable, *, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, ...] = (3.4445, -4.775, 2.0315),
                 update_scale: str = "rms_match", betas: tuple[float, ...] = (0.9, 0.95), eps: float = 1e-8,
                 ns_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
                 orthogonalizer: str = "newton_schulz", cautious_weight_decay: bool = False):
        if len(ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients {ns_coefficients} must be three numbers (a, b, c)")
        if orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"orthogonalizer {orthogonalizer!r} is not one of {', '.join(ORTHOGONALIZERS)}")
        if update_scale not in UPDATE_SCALES:
            raise ValueError(f"update_scale {update_scale!r} is not one of {', '.join(UPDATE_SCALES)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, use_muon=True, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), update_scale=update_scale,
                        betas=tuple(betas), eps=eps, orthogonalizer=orthogonalizer,
                        cautious_weight_decay=cautious_weight_decay)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.bucket_bytes = bucket_bytes
        self._layouts = Layouts()  # every rank's block of each parameter, exchanged at the first step
        self._plans: dict[tuple, list[Unit]] = {}  # per parameter set: its matrices and their owners

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure_loss(closure)
        sharded: list[tuple[torch.Tensor, DTensor, dict]] = []
        whole: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # matrices held whole: batched by shape
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not group["use_muon"]:
                    self._adamw_step(param, group)
                    continue
                update = self._momentum(param, group)
                if isinstance(update, DTensor):
                    sharded.append((param, update, group))
                elif update.dim() == 2:
                    whole.append((param, update, group))
                else:  # stacked experts (E, m, n): one batched call already
                    self._apply(param, group, self._orthogonalize(group, update))
        # The matrices of one shape and group in one batched call: a few large kernels where a
        # model's layers would make dozens of small ones (the same arithmetic, matrix by matrix).
        orthos = self._orthogonalize_many([g for _, _, g in whole], [u for _, u, _ in whole])
        for (param, _, group), ortho in zip(whole, orthos):
            self._apply(param, group, ortho)
        by_mesh: dict[tuple, list] = {}  # one exchange per mesh and dtype, in parameter order
        for item in sharded:
            by_mesh.setdefault((item[1].device_mesh, item[1].dtype), []).append(item)
        for items in by_mesh.values():
            self._step_sharded(items)
        return loss

    def _momentum(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        if param.dim() not in (2, 3):
            raise ValueError(f"Muon takes 2-D or 3-D parameters; got shape {tuple(param.shape)}")
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buf, grad, momentum = state["momentum_buffer"], param.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _orthogonalize(self, group: dict, update: torch.Tensor) -> torch.Tensor:
        dtype = self.ns_dtype or default_ns_dtype(update.device)
        return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], dtype,
                             group.get("orthogonalizer", "newton_schulz"))

    def _apply(self, param: torch.Tensor, group: dict, ortho: torch.Tensor) -> None:
        rows, cols = param.shape[-2:]
        lr, decay = group["lr"], group["weight_decay"]
        if group.get("cautious_weight_decay") and decay:
            # Decay only where the update moves the weight as the decay would (same signs).
            param.sub_(param * (ortho * param > 0), alpha=lr * decay)
        else:
            param.mul_(1 - lr * decay)  # decoupled weight decay
        param.add_(ortho, alpha=-lr * update_scale(group["update_scale"], rows, cols))

    def _step_sharded(self, items: list[tuple[torch.Tensor, DTensor, dict]]) -> None:
        """Orthogonalize the DTensor updates of one mesh (module docstring), then step."""
        mesh = items[0][1].device_mesh
        pg, ranks = mesh_group(mesh)
        n, me = len(ranks), ranks.index(dist.get_rank())
        key = tuple(id(p) for p, _, _ in items)
        boxes = self._layouts.boxes(key, [u for _, u, _ in items], pg, n)  # (n, P, 6)
        if key not in self._plans:
            shapes = [tuple(u.shape) if u.dim() == 3 else (1, *u.shape) for _, u, _ in items]
            self._plans[key] = plan_units(shapes, boxes)
        units = self._plans[key]
        offsets = [tuple(boxes[me, i, :3].tolist()) for i in range(len(items))]
        locals_ = [u.to_local().contiguous().view(boxes[me, i, 3:].tolist()) for i, (_, u, _) in enumerate(items)]
        outputs = [torch.empty_like(t) for t in locals_]
        groups = [g for _, _, g in items]

        def orthogonalize(mine: list[Unit], fulls: list[torch.Tensor]) -> list[torch.Tensor]:
            return self._orthogonalize_many([groups[u.index] for u in mine], fulls)

        moving = buckets(units, max(self.bucket_bytes // locals_[0].element_size(), 1))
        in_buckets = {id(u) for bucket in moving for u in bucket}
        here = [u for u in units if u.owner == me and id(u) not in in_buckets]  # held whole, by this rank only
        for u, result in zip(here, orthogonalize(here, [locals_[u.index][u.expert - offsets[u.index][0]]
                                                        for u in here])):
            outputs[u.index][u.expert - offsets[u.index][0]] = result
        for bucket in moving:
            exchange_bucket(bucket, locals_, offsets, outputs, me, n, pg, orthogonalize)
        for (param, update, group), out in zip(items, outputs):
            ortho = DTensor.from_local(out.view(update.to_local().shape), mesh, update.placements,
                                       run_check=False, shape=update.shape, stride=update.stride())
            self._apply(param, group, ortho)

    def _orthogonalize_many(self, groups: list[dict], fulls: list[torch.Tensor]) -> list[torch.Tensor]:
        """NS of each matrix, those of one shape and group stacked into one batched call."""
        results: list[torch.Tensor | None] = [None] * len(fulls)
        batches: dict[tuple, list[int]] = {}
        for i, (group, full) in enumerate(zip(groups, fulls)):
            batches.setdefault((tuple(full.shape), id(group)), []).append(i)
        for indices in batches.values():
            if len(indices) == 1:  # as one process computes it: 2-D, the same kernels
                results[indices[0]] = self._orthogonalize(groups[indices[0]], fulls[indices[0]])
                continue
            stacked = torch.stack([fulls[i] for i in indices])  # (k, m, n)
            for i, o in zip(indices, self._orthogonalize(groups[indices[0]], stacked)):
                results[i] = o
        return results

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
