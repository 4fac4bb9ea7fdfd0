"""Fused SwiGLU activation: silu(gate) * up, the middle of forja's SwiGLU feed-forward.

Eager PyTorch runs two kernels and keeps silu(gate) for backward; the fused forward reads
gate and up once and writes the product, and backward recomputes silu from gate, so only the
inputs are saved. The math is float32, with intermediates rounded to the input dtype where
eager rounds them (silu(gate), and dy * up before silu's backward), so in bf16 the kernels
agree with `F.silu(gate) * up` to within the last bit of `exp`.

Flat elementwise kernels over gate.numel() elements, BLOCK per program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from forja.errors import ForjaError
from forja.ops.dispatch import as_output, jit, local_shards, record_fallback, use_triton, waited

try:
    import triton.language as tl
except Exception:  # kernels are defined but never launched without triton
    tl = None

_BLOCK = 1024
_WARPS = 4


@jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dt = G.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu returns gate's dtype
    tl.store(Y + offs, (silu * u).to(dt), mask=mask)


@jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dt = G.dtype.element_ty
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # the forward's value, recomputed
    tl.store(DU + offs, (dy * silu).to(dt), mask=mask)
    # silu'(g) = sig * (1 + g * (1 - sig)); eager feeds it dy * up rounded to the dtype.
    dy_u = (dy * u).to(dt).to(tl.float32)
    tl.store(DG + offs, (dy_u * sig * (1.0 + g * (1.0 - sig))).to(dt), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (-(-n // _BLOCK),)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = waited(gate).contiguous(), waited(up).contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _swiglu_fwd_kernel[_grid(n)](gate, up, y, n, BLOCK=_BLOCK, num_warps=_WARPS)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = waited(dy).contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd_kernel[_grid(n)](dy, gate, up, dgate, dup, n, BLOCK=_BLOCK, num_warps=_WARPS)
        return dgate, dup


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The PyTorch definition (that of forja's SwiGLU module)."""
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of the same shape; the Triton kernel on CUDA."""
    if gate.shape != up.shape:
        raise ForjaError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    shards = local_shards((gate, up), keep_dims=()) if isinstance(gate, DTensor) else None
    if shards is not None:  # elementwise: each rank computes its own shard
        (gate_local, up_local), like = shards
        if _fused(gate_local, up_local):
            return as_output(_SwiGLUFunction.apply(gate_local, up_local), like)
        return swiglu_reference(gate, up)
    if _fused(gate, up):
        return _SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)


def _fused(gate: torch.Tensor, up: torch.Tensor) -> bool:
    if not use_triton(gate, up, op="swiglu"):
        return False
    if gate.dtype != up.dtype:
        record_fallback("swiglu", f"gate ({gate.dtype}) and up ({up.dtype}) differ in dtype",
                        fix="give both projections one dtype")
        return False
    return True
