"""Fused RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)), over the last dimension.

The semantics are those of `forja.models.common.norms.RMSNorm`: the statistics and the
normalization in float32, the normalized row cast back to x's dtype, then multiplied by the
weight, so the result has `torch.promote_types(x.dtype, weight.dtype)`.

The kernels round intermediates exactly where eager PyTorch rounds them (the normalized row
to x's dtype; in backward, weight * dy to x's dtype and each dy * row product to the output
dtype before summing), so in bf16 they agree with the reference to the last bit on most
elements; only the order of the float32 sums differs.

Forward: one program per row, the whole row in one block (rows up to 65536 elements). It
saves 1/rms per row (float32) for backward. Backward: a fixed number of programs (four per
SM), each looping over a contiguous range of rows, writing dx per row and keeping its own
float32 partial sum of dweight; the partials are summed afterwards in a fixed order, so
dweight is deterministic. Same plan as Liger Kernel's RMSNorm (linkedin/Liger-Kernel).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from forja.errors import ForjaError
from forja.ops.dispatch import (
    as_output,
    jit,
    kernel_promised,
    local_shards,
    program_count,
    record_fallback,
    row_block,
    use_triton,
    waited,
)

try:
    import triton.language as tl
except Exception:  # kernels are defined but never launched without triton
    tl = None


@jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # The module casts the normalized row back to x's dtype before the weight multiplies it.
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx,
                         n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    # Row pointers advance by their stride each step (64-bit pointer arithmetic).
    x_ptr = X + row_start.to(tl.int64) * stride_x
    dy_ptr = DY + row_start.to(tl.int64) * stride_dy
    dx_ptr = DX + row_start.to(tl.int64) * stride_dx
    for row in range(row_start, row_end):
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        normed = x * rstd
        normed_cast = normed.to(X.dtype.element_ty).to(tl.float32)
        # Eager computes dy * normed in the output dtype, element by element, then sums.
        dw += (dy * normed_cast).to(DY.dtype.element_ty).to(tl.float32)
        # ...and dy * weight reaches the float32 normalization as a value of x's dtype.
        dn = (dy * w).to(X.dtype.element_ty).to(tl.float32)
        # d/dx of x * rstd(x): rstd * (dn - normed * mean(dn * normed)).
        dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / n_cols))
        tl.store(dx_ptr + cols, dx.to(DX.dtype.element_ty), mask=mask)
        x_ptr += stride_x
        dy_ptr += stride_dy
        dx_ptr += stride_dx
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (N, D) rows with unit column stride, a view when the layout allows it."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    rows = _rows(x)  # (N, D)
    n_rows, n_cols = rows.shape
    block, warps = row_block(n_cols, "rms_norm")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)  # (N,)
    if n_rows:
        _rms_norm_fwd_kernel[(n_rows,)](
            rows, weight, y, rstd, rows.stride(0), y.stride(0), n_cols, eps, BLOCK=block, num_warps=warps)
    return y.view(x.shape), rows, rstd


def _backward(dy: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    dy = _rows(dy)  # (N, D)
    n_rows, n_cols = rows.shape
    block, warps = row_block(n_cols, "rms_norm")
    programs = program_count(rows.device, n_rows)
    rows_per_program = -(-n_rows // programs)
    dx = torch.empty_like(rows)
    dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=rows.device)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            dy, rows, weight, rstd, dx, dw_part, dy.stride(0), rows.stride(0), dx.stride(0),
            n_rows, n_cols, rows_per_program, BLOCK=block, num_warps=warps)
    else:
        dw_part.zero_()
    return dx, dw_part.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x, weight = waited(x), waited(weight).contiguous()
        y, rows, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(waited(dy), rows, weight, rstd)
        dx = dx.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, dw if ctx.needs_input_grad[1] else None, None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The PyTorch definition (that of forja's RMSNorm module, operation for operation)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of x (..., D) with weight (D,); the Triton kernel on CUDA, else the reference.
    A DTensor x split along its rows (sequence parallelism) runs the kernel on each rank's rows."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ForjaError(f"rms_norm: weight of shape {tuple(weight.shape)} does not fit inputs of shape "
                         f"{tuple(x.shape)}; it must be ({x.shape[-1]},)")
    if isinstance(x, DTensor):
        # Sequence parallelism: rows split over ranks, each normalized alone on its rank.
        shards = local_shards((x, weight), keep_dims=(-1,))
        if shards is None:
            if kernel_promised(x):
                record_fallback("rms_norm", f"its input's placements {tuple(x.placements)} split the "
                                "normalized dimension or hold partial sums")
        elif use_triton(*shards[0], op="rms_norm"):
            (x_local, w_local), like = shards
            return as_output(_RMSNormFunction.apply(x_local, w_local, eps), like)
        return rms_norm_reference(x, weight, eps)
    if use_triton(x, weight, op="rms_norm"):
        return _RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
