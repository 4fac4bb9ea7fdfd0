"""Fused linear cross-entropy: the output projection and the loss, without the logits.

`fused_linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy((hidden @ weight.T).float(), targets)` (mean over non-ignored targets)
but never holds the (tokens, vocab) logits: at 8k tokens and a 128k vocabulary those
are 4.2 GB in fp32, and plain autograd keeps them, their log-softmax and their gradient.

How: the tokens are cut into chunks. For each chunk the forward computes its logits
(C, V), their logsumexp and loss, and at once their gradient (softmax - onehot) / n,
which it turns into the chunk's rows of d(hidden) = dlogits @ W and adds to
d(weight) += dlogits^T @ h (in fp32). The chunk's logits are then dropped; only
d(hidden) (N, D) and d(weight) (V, D) are kept, and backward just scales them by the
incoming gradient. This is the approach of Liger Kernel's fused linear cross-entropy
and torchtune's chunked loss (Apple's Cut Cross-Entropy goes further, never storing a
chunk's logits in global memory, at the price of custom matmul kernels). Three matmuls
of N x D x V, as plain autograd does: no recomputation.

- **Chunking**: `chunk_rows(N, V)` tokens per chunk, the largest power of two whose fp32
  logits fit in `LOGITS_BUDGET_BYTES` (256 MiB): 512 tokens at V = 128,256. `chunk_size`
  overrides it.
- **Per-chunk softmax**: on CUDA a Triton kernel pair (row max and sum of exponentials;
  then softmax - onehot written in place into the logits buffer, in its dtype);
  elsewhere the same math in PyTorch, in place on an fp32 copy of the chunk's logits
  (the logits themselves when fp32), one exp per element. `forja.ops.dispatch` chooses
  (FORJA_OPS overrides it; `backend=` forces one). The matmuls are PyTorch's (cuBLAS).
- **Dtypes**: logits are computed in the inputs' dtype (or autocast's, when it is on:
  the model's forward runs under autocast) and upcast to fp32 for the softmax; the loss
  is fp32; gradients come back in the dtypes of `hidden` and `weight`. In bf16 each
  chunk's d(weight) product is rounded to bf16 before the fp32 sum (cuBLAS-speed
  matmuls), so d(weight) differs from the plain loss's by about that rounding.
- **Ignored targets** (`ignore_index`) contribute nothing. When *every* target is
  ignored the loss is 0 with zero gradients; `F.cross_entropy` returns nan there. Here a
  micro-batch without targets must not turn a whole step into nan.
- **Tensor parallelism**: a `weight` that is a DTensor sharded on the vocabulary
  (`Shard(0)`, as `ColwiseParallel` leaves the output projection) over a 1-D mesh is
  handled vocabulary-parallel: each rank computes its slice of every chunk's logits and
  the ranks all-reduce the row maxima, the sums of exponentials and the target logits
  (Megatron-LM's vocabulary-parallel cross-entropy): two small all-reduces per chunk,
  plus one for the target logits. `hidden` may be a plain tensor (the same on every
  rank) or a DTensor on the same mesh (e.g. sequence-sharded); each rank's d(hidden) is
  a partial sum that DTensor reduces on the way back. Other layouts raise a ForjaError
  naming `model.fused_ops`.
- **Target ids** outside the vocabulary are refused (on CUDA by a device-side assert,
  as F.cross_entropy does), never silently counted as "on another rank".
- **Backward once**: the gradients are computed in the forward and handed over in
  place; a second backward through the same graph (`retain_graph=True`) raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from forja.errors import ForjaError
from forja.ops.dispatch import interpreting, jit, next_power_of_2, triton_available, use_triton

try:
    import triton.language as tl
except Exception:  # the kernels are defined but never launched without triton
    tl = None


LOGITS_BUDGET_BYTES = 256 * 2**20
"""Most bytes of one chunk's fp32 logits (the PyTorch path's work buffer)."""
DW_SLICE_BYTES = 128 * 2**20
"""Most bytes of the low-precision partial d(weight) a chunk adds to the fp32 sum at once."""
BLOCK = 4096
"""Columns a Triton program handles at once (a power of two)."""


def chunk_rows(n_rows: int, vocab: int, budget_bytes: int | None = None) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits (rows, vocab) fit in
    `budget_bytes` (default `LOGITS_BUDGET_BYTES`), at least 1 and at most `n_rows`."""
    fit = max(1, (budget_bytes or LOGITS_BUDGET_BYTES) // (4 * max(vocab, 1)))
    return max(1, min(n_rows, 1 << (fit.bit_length() - 1)))


# -- the per-chunk softmax: PyTorch -----------------------------------------------------------

def _softmax_grad_torch(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None,
                        group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dlogits (C, V) fp32, logsumexp (C,)) of logits (C, V): dlogits = (softmax -
    onehot(target)) * scale, computed in place in an fp32 copy of the logits (in the
    logits themselves when they are fp32), one exp per element and no other (C, V)
    buffer. target (C,) int64 is -1 where the row's target is not among these columns;
    scale (C,) fp32, or None for the loss alone. Under TP the max and the sum of
    exponentials are reduced over `group`, so the softmax is over the whole vocabulary."""
    x = logits.float()
    m = x.amax(dim=1)  # (C,)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    x.sub_(m[:, None]).exp_()
    s = x.sum(dim=1)  # (C,)
    if group is not None:
        dist.all_reduce(s, group=group)
    if scale is not None:
        x.mul_((scale / s)[:, None])
        x.scatter_add_(1, target.clamp(min=0)[:, None], -(scale * (target >= 0))[:, None])
    return x, m + torch.log(s)


# -- the per-chunk softmax: Triton ------------------------------------------------------------

@jit
def _stats_kernel(x_ptr, stride, n_cols, max_ptr, sum_ptr, BLOCK: tl.constexpr):
    """One program per row: running max and rescaled sum of exponentials, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))  # finite: every block has a real column
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)


@jit
def _grad_kernel(x_ptr, stride, n_cols, lse_ptr, target_ptr, scale_ptr, BLOCK: tl.constexpr):
    """Program (row, block): (exp(x - lse) - onehot) * scale over BLOCK columns, written
    back in place in the buffer's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptrs = x_ptr + row * stride + cols
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    target = tl.load(target_ptr + row)
    scale = tl.load(scale_ptr + row)
    grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
    tl.store(ptrs, grad.to(x_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int, block: int | None) -> int:
    return block or min(BLOCK, next_power_of_2(n_cols))


def _stats_triton(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maxima m and sums of exp(x - m), (C,) fp32 each, of x (C, V) in any float dtype."""
    rows, cols = x.shape
    m = torch.empty(rows, device=x.device, dtype=torch.float32)
    s = torch.empty_like(m)
    _stats_kernel[(rows,)](x, x.stride(0), cols, m, s, BLOCK=_block(cols, block), num_warps=8)
    return m, s


def _grad_triton_(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                  block: int | None = None) -> None:
    """x (C, V) becomes (exp(x - lse) - onehot(target)) * scale, in place in its own dtype."""
    rows, cols = x.shape
    b = _block(cols, block)
    _grad_kernel[(rows, -(-cols // b))](x, x.stride(0), cols, lse, target, scale, BLOCK=b, num_warps=8)


def _softmax_grad_triton(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None,
                         group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """As `_softmax_grad_torch`, with the kernels, in place in the logits' own dtype."""
    m, s = _stats_triton(logits)
    if group is not None:  # combine the ranks' partial maxima and sums
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        s = s * torch.exp(m - top)
        dist.all_reduce(s, group=group)
        m = top
    lse = m + torch.log(s)
    if scale is not None:
        _grad_triton_(logits, lse, target, scale)
    return logits, lse


# -- the chunk loop ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    ignore_index: int
    chunk: int
    backend: str
    """"torch" or "triton": who computes the per-chunk softmax."""
    compute_dtype: torch.dtype
    """The matmuls' dtype (the logits')."""
    want_dh: bool
    want_dw: bool
    group: dist.ProcessGroup | None = None
    """The tensor-parallel group over which the vocabulary is split; None: not split."""
    vocab_start: int = 0
    """The first vocabulary row of this rank's weight shard."""


def _target_logits(logits: torch.Tensor, target: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Each row's logit (fp32) at its target; 0 where the target is ignored."""
    picked = logits.gather(1, target.clamp(min=0)[:, None]).squeeze(1).float()
    picked = torch.where(target >= 0, picked, 0.0)
    if plan.group is not None:  # exactly one rank holds each target's column
        dist.all_reduce(picked, group=plan.group)
    return picked


def _add_dw(dw: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """dw (V, D) fp32 += dlogits (C, V)^T @ h (C, D). In low precision the product is
    formed in slices of the vocabulary, to bound the temporary it needs."""
    if dlogits.dtype == dw.dtype:
        dw.addmm_(dlogits.T, h)
        return
    step = max(1, DW_SLICE_BYTES // (h.shape[1] * h.element_size()))
    for a in range(0, dw.shape[0], step):
        dw[a:a + step] += dlogits[:, a:a + step].T @ h


def _forward_with_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        plan: _Plan) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss, d loss/d hidden, d loss/d weight), chunk by chunk. hidden (N, D),
    weight (V, D) (this rank's vocabulary rows), targets (N,) global vocabulary ids."""
    n, vocab = hidden.shape[0], weight.shape[0]
    h_all = hidden.to(plan.compute_dtype)
    w = weight.to(plan.compute_dtype)
    valid = targets != plan.ignore_index  # (N,)
    inv_count = 1.0 / valid.sum().clamp(min=1).float()  # a tensor: no host sync
    row_scale = valid.float() * inv_count  # (N,) d loss / d row loss
    local = targets - plan.vocab_start
    local = torch.where(valid & (local >= 0) & (local < vocab), local, -1)  # (N,) -1: not here

    loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
    dh = torch.empty_like(hidden) if plan.want_dh else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if plan.want_dw else None
    for a in range(0, n, plan.chunk):
        b = min(a + plan.chunk, n)
        h, target = h_all[a:b], local[a:b]
        logits = h @ w.T  # (C, V) in the compute dtype
        picked = _target_logits(logits, target, plan)  # before the logits are overwritten
        softmax_grad = _softmax_grad_triton if plan.backend == "triton" else _softmax_grad_torch
        scale = row_scale[a:b] if dh is not None or dw is not None else None
        dlogits, lse = softmax_grad(logits, target, scale, plan.group)  # (C, V), (C,)
        loss_sum += ((lse - picked) * valid[a:b]).sum()
        if scale is None:
            continue
        del logits  # PyTorch path in bf16: only its fp32 copy is still needed
        dlogits = dlogits.to(plan.compute_dtype)  # a copy in that case only
        if dh is not None:
            dh[a:b] = dlogits @ w
        if dw is not None:
            _add_dw(dw, dlogits, h)
    if dw is not None:
        dw = dw.to(weight.dtype)  # now rather than in backward: the fp32 sum is freed earlier
    return loss_sum * inv_count, dh, dw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, plan):
        with torch.autocast(hidden.device.type, enabled=False):  # plan.compute_dtype decides
            loss, dh, dw = _forward_with_grads(hidden, weight, targets, plan)
        ctx.grads = (dh, dw)  # not inputs or outputs: kept on ctx, freed in backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise ForjaError("fused_linear_cross_entropy computes its gradients in the forward pass and "
                             "hands them over once: backward through it a second time (retain_graph=True) "
                             "is not possible; compute the loss again, or set model.fused_ops off for "
                             "cross_entropy")
        dh, dw = ctx.grads
        ctx.grads = None
        # In place: these buffers are ours alone, and a copy would double the peak.
        if dh is not None:
            dh.mul_(grad_loss)
        if dw is not None:
            dw.mul_(grad_loss)
        return dh, dw, None, None


# -- the public function ----------------------------------------------------------------------

def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100, *, chunk_size: int | None = None,
                               backend: str | None = None) -> torch.Tensor:
    """Mean cross-entropy (0-dim, fp32) of the logits `hidden @ weight.T` against `targets`,
    computed chunk by chunk without ever holding all logits (see the module docstring).

    hidden (..., D) and targets (...) int: leading dimensions are flattened (N tokens);
    weight (V, D): the output projection, or a DTensor of it sharded on the vocabulary.
    Tokens whose target is `ignore_index` count for nothing; if all are ignored the loss is
    0 (F.cross_entropy: nan). `chunk_size`: tokens per chunk (default: `chunk_rows`).
    `backend`: "torch" or "triton" for the per-chunk softmax (default: Triton on CUDA).
    """
    group, vocab_start, vocab = None, 0, weight.shape[0]  # the whole vocabulary, also of a DTensor
    if isinstance(weight, DTensor):
        hidden, weight, targets, group, vocab_start = _vocab_parallel_inputs(hidden, weight, targets)
    elif isinstance(hidden, DTensor):
        raise ForjaError("fused_linear_cross_entropy got a DTensor hidden state but a plain weight; under "
                         "tensor parallelism pass the output projection's (vocabulary-sharded) weight "
                         "DTensor, or set model.fused_ops off for cross_entropy")
    hidden, targets = _checked(hidden, weight, targets)
    _check_target_ids(targets, ignore_index, vocab)
    if backend is None:
        backend = "triton" if use_triton(hidden, weight, op="cross_entropy") else "torch"
    if backend not in ("torch", "triton"):
        raise ForjaError(f"fused_linear_cross_entropy backend={backend!r} is not 'torch' or 'triton'")
    if backend == "triton" and not (triton_available() and (hidden.is_cuda or interpreting())):
        raise ForjaError("fused_linear_cross_entropy backend='triton' needs Triton and CUDA tensors (or "
                         "Triton's interpreter, TRITON_INTERPRET=1); use backend='torch'")
    if chunk_size is not None and chunk_size < 1:
        raise ForjaError(f"fused_linear_cross_entropy chunk_size={chunk_size} must be at least 1")
    grad = torch.is_grad_enabled()
    plan = _Plan(ignore_index=ignore_index, chunk=chunk_size or chunk_rows(hidden.shape[0], weight.shape[0]),
                 backend=backend, compute_dtype=_compute_dtype(hidden, weight),
                 want_dh=grad and hidden.requires_grad, want_dw=grad and weight.requires_grad,
                 group=group, vocab_start=vocab_start)
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets, plan)


def _checked(hidden: torch.Tensor, weight: torch.Tensor,
             targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, D) and targets (N,) int64, after checking what the caller passed."""
    if weight.ndim != 2 or hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ForjaError(f"fused_linear_cross_entropy needs hidden (..., D) and weight (V, D); got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ForjaError(f"fused_linear_cross_entropy needs one target per hidden row: targets "
                         f"{tuple(targets.shape)}, hidden {tuple(hidden.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point() or targets.is_floating_point():
        raise ForjaError(f"fused_linear_cross_entropy needs float hidden and weight and integer targets; got "
                         f"{hidden.dtype}, {weight.dtype}, {targets.dtype}")
    if hidden.device != weight.device or targets.device != weight.device:
        raise ForjaError(f"fused_linear_cross_entropy needs its inputs on one device; got hidden on "
                         f"{hidden.device}, weight on {weight.device}, targets on {targets.device}")
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long()


def _check_target_ids(targets: torch.Tensor, ignore_index: int, vocab: int) -> None:
    """Ids outside the vocabulary would silently count as "on another rank": refuse them.
    On CUDA without a host sync (a device-side assert, as F.cross_entropy's)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if targets.is_cuda:
        torch._assert_async(~bad.any(), f"fused_linear_cross_entropy: a target id is outside the "
                                        f"vocabulary of {vocab}")
    elif bad.any():
        raise ForjaError(f"fused_linear_cross_entropy got target id {targets[bad][0].item()} outside the "
                         f"vocabulary of {vocab} (ignore_index is {ignore_index}); the data and the "
                         "model's vocab_size do not match")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The logits' dtype: autocast's when it is on (as the plain `output(h)` would be),
    else the inputs' common dtype."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _vocab_parallel_inputs(hidden, weight: DTensor, targets):
    """Local tensors for the vocabulary-parallel loss: (hidden (..., D) the same on every
    rank, this rank's weight rows, targets, tp group, first vocabulary row of this rank)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) not in ((Shard(0),), (Replicate(),)):
        raise ForjaError(f"fused_linear_cross_entropy supports an output weight sharded on the vocabulary "
                         f"(Shard(0)) over a 1-D tensor-parallel mesh; got placements "
                         f"{tuple(weight.placements)} over a {mesh.ndim}-D mesh. Set model.fused_ops off "
                         "for cross_entropy (model.fused_ops_overrides = {cross_entropy = false})")
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    if isinstance(hidden, DTensor) and hidden.device_mesh != mesh:
        raise ForjaError("fused_linear_cross_entropy needs hidden and weight DTensors on the same mesh; "
                         "set model.fused_ops off for cross_entropy")
    if not isinstance(hidden, DTensor):  # the same on every rank: view it as replicated
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    replicated = weight.placements[0] == Replicate()
    # Each rank's d(hidden) covers its vocabulary slice only: a partial sum, reduced by
    # DTensor on the way back (an all-reduce, or a reduce-scatter for a sharded hidden).
    hidden = hidden.redistribute(mesh, [Replicate()]).to_local(
        grad_placements=[Replicate() if replicated else Partial()])
    local = weight.to_local()
    if replicated:
        return hidden, local, targets, None, 0
    vocab, size, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    start = min(rank * math.ceil(vocab / size), vocab)  # DTensor's Shard: torch.chunk's split
    if local.shape[0] != min(vocab - start, math.ceil(vocab / size)):
        raise ForjaError(f"fused_linear_cross_entropy cannot place rank {rank}'s {local.shape[0]} weight rows "
                         f"in the vocabulary of {vocab}; set model.fused_ops off for cross_entropy")
    return hidden, local, targets, mesh.get_group(), start
