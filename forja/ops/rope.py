"""Fused rotary position embedding (RoPE) of queries and keys, "rotate half" layout.

Semantics of `apply_rope` (below: the PyTorch reference, which the models also use), for
q (B, T, H, hd) and k (B, T, Hkv, hd) with tables cos, sin (T, hd): with x = (x1, x2) the
two halves of a head,

    y1 = x1 * cos1 - x2 * sin1        y2 = x2 * cos2 + x1 * sin2

(cos1/cos2 the halves of the cos row; for forja's tables they are equal). Backward is the
same kernel rotating the other way: dx1 = dy1 * cos1 + dy2 * sin2, dx2 = dy2 * cos2 - dy1 * sin1.
The tables are constants: no gradient flows to cos and sin.

Rounding follows eager PyTorch: the tables are cast to x's dtype first, and each product and
the sum are rounded to x's dtype (in bf16 the kernel agrees with `apply_rope` bit for bit,
forward and backward, unless the compiler fuses a float32 multiply-add).

One program per (token, block of heads): it loads the token's cos/sin row once and rotates
every head of the block. q and k are two launches of the same kernel; any strides are
accepted as long as the head dimension is contiguous (the `.view` of a linear output is).
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
    next_power_of_2,
    record_fallback,
    use_triton,
    waited,
)

try:
    import triton.language as tl
except Exception:  # kernels are defined but never launched without triton
    tl = None

_ELEMENTS_PER_PROGRAM = 2048
"""Half-head elements one program rotates (its heads x hd/2): bounds registers per thread."""


@jit
def _rope_kernel(X, COS, SIN, Y, seq_len, n_heads, half,
                 stride_xb, stride_xt, stride_xh, stride_yb, stride_yt, stride_yh, stride_cos,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    t = (token % seq_len).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,) positions within a half
    d_mask = d < half
    mask = (heads < n_heads)[:, None] & d_mask[None, :]  # (BLOCK_H, BLOCK_D)
    dt = X.dtype.element_ty

    # apply_rope casts the float32 tables to x's dtype before multiplying.
    table = t * stride_cos + d
    cos1 = tl.load(COS + table, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    cos2 = tl.load(COS + table + half, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + table, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + table + half, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    # y1 = x1 * cos1 + x2 * a, y2 = x2 * cos2 + x1 * c: forward rotates by +angle, backward
    # (the transpose) by -angle.
    if BACKWARD:
        a = sin2
        c = -sin1
    else:
        a = -sin1
        c = sin2

    x_at = X + b * stride_xb + t * stride_xt + heads.to(tl.int64)[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_D)
    x2 = tl.load(x_at + half, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded to x's dtype, then the sum: the three ops eager runs.
    y1 = (x1 * cos1).to(dt).to(tl.float32) + (x2 * a).to(dt).to(tl.float32)
    y2 = (x2 * cos2).to(dt).to(tl.float32) + (x1 * c).to(dt).to(tl.float32)
    y_at = Y + b * stride_yb + t * stride_yt + heads.to(tl.int64)[:, None] * stride_yh + d[None, :]
    tl.store(y_at, y1.to(dt), mask=mask)
    tl.store(y_at + half, y2.to(dt), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x (B, T, H, hd) rotated by the angles of cos/sin (T, hd), as a new contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, T, H, hd = x.shape
    half = hd // 2
    y = torch.empty((B, T, H, hd), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    block_d = next_power_of_2(half)
    block_h = min(next_power_of_2(H), max(1, _ELEMENTS_PER_PROGRAM // block_d))
    grid = (B * T, -(-H // block_h))
    _rope_kernel[grid](
        x, cos, sin, y, T, H, half,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), cos.stride(0),
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return y


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(waited(q), cos, sin, False), _rotate(waited(k), cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq = _rotate(waited(dq), cos, sin, True) if ctx.needs_input_grad[0] else None
        dk = _rotate(waited(dk), cos, sin, True) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, hd) by the angles of cos/sin (T, hd), in x's dtype: the definition.

    The models call it directly (through forja.models.common.rope) when the fused op is off.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos = cos.to(x.dtype)[None, :, None, :]  # (1, T, 1, hd)
    sin = sin.to(x.dtype)[None, :, None, :]
    return x * cos + rotated * sin


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch definition: `apply_rope` on q and on k."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ForjaError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, T, heads, head_dim) "
                         f"with the same B, T and head_dim")
    T, hd = q.shape[1], q.shape[-1]
    if hd % 2 or cos.shape != (T, hd) or sin.shape != (T, hd):
        raise ForjaError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be ({T}, {hd}) "
                         f"for q of shape {tuple(q.shape)}, with an even head_dim")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, hd) and k (B, T, Hkv, hd) rotated by cos/sin (T, hd); Triton on CUDA."""
    _check(q, k, cos, sin)
    if isinstance(q, DTensor) or isinstance(k, DTensor):
        # Split by heads (or batch), each token's positions whole: each rank rotates its own heads.
        # forja's plans hand q and k over as local tensors already (column-parallel projections).
        qs = local_shards((q, cos, sin), keep_dims=(1, 3))
        ks = local_shards((k, cos, sin), keep_dims=(1, 3))
        if qs is not None and ks is not None and tuple(q.placements) == tuple(k.placements):
            (q_local, cos_local, sin_local), (k_local, _, _) = qs[0], ks[0]
            if _fused(q_local, k_local, cos_local, sin_local):
                qo, ko = _RopeFunction.apply(q_local, k_local, cos_local.contiguous(), sin_local.contiguous())
                return as_output(qo, q), as_output(ko, k)
        elif kernel_promised(q, k):
            record_fallback("rope", "q and k are not DTensors split alike along batch or heads with whole "
                            "sequences")
        return rope_reference(q, k, cos, sin)
    if _fused(q, k, cos, sin):
        # Contiguous (a no-op for forja's tables) so one row stride serves both.
        return _RopeFunction.apply(q, k, cos.contiguous(), sin.contiguous())
    return rope_reference(q, k, cos, sin)


def _fused(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernels take these plain tensors; gradients to the tables, or q and k of two
    dtypes, are left to the reference (and recorded)."""
    if not use_triton(q, k, cos, sin, op="rope"):
        return False
    if q.dtype != k.dtype:
        record_fallback("rope", f"q ({q.dtype}) and k ({k.dtype}) differ in dtype", fix="give q and k one dtype")
        return False
    if cos.requires_grad or sin.requires_grad:
        record_fallback("rope", "the cos/sin tables require gradients, which the kernel does not compute",
                        fix="detach the tables")
        return False
    return True
