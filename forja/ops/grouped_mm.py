"""Grouped matrix multiply: one weight matrix per group of rows, for a mixture of experts.

Rows of `x` arrive sorted by group (expert); `counts[g]` rows belong to group g, whose
weight is `w[g]` in nn.Linear's (out, in) layout:

    out[rows of g] = x[rows of g] @ w[g].T        x (M, K), w (G, N, K) -> (M, N)

Two implementations with the same result:

- "grouped": `torch._grouped_mm`, one kernel for every group (CUTLASS on Hopper and later
  GPUs, in bf16 with 16-byte aligned strides; a fallback kernel on CPU in recent torch).
  It is an underscore API: it is what torchtitan and transformers call, and PyTorch has no
  public name for it yet.
- "loop": one `F.linear` per non-empty group, the reference; it runs everywhere.

On CUDA the rows go to the kernel in a padded copy where every group starts at a multiple
of 16 bytes' worth of rows (8 in bf16), pad rows zero, and the real rows come back from its
output (`padded_groups`). PyTorch's kernels check 16-byte group starts along the grouped
dimension (aten/src/ATen/native/cuda/GroupMMCommon.cuh, prepare_grouped_gemm_data, and the
cuBLASLt path's argument kernel): before pytorch/pytorch#155466 (June 2025) for every layout,
since then only where that dimension is the contiguous one, which the row-major activations
and gradients here avoid. The copy costs a scatter and a gather of the rows per matmul and
keeps the op right whichever torch a GPU runs; torchtitan padded to the same 8 rows in bf16
(TOKEN_GROUP_ALIGN_SIZE_M) until it dropped the padding for bf16 (torchtitan#2774). The
pad's size, rows + G * (align - 1), does not depend on the counts: no device-to-host sync,
and fixed shapes for torch.compile. The copy is a fresh allocation, so its start is 16-byte
aligned whatever view `x` was.

`impl="auto"` takes "grouped" where the device and dtype support it, else "loop";
`impl="grouped"` does the same, and records the loop in the fallback record
(forja/fallbacks.py) where the op cannot run: the user asked for it by name.

Under autocast the dtype that counts is autocast's, not the parameters': the default GPU
precision is bf16 autocast over fp32 weights, and the loop's F.linear would compute in bf16
anyway. So the routed rows and the expert weights are cast to the autocast dtype and the
grouped kernel takes them (the weights' cast is what autocast does for F.linear too).
"""

from __future__ import annotations

import concurrent.futures
from functools import cache

import torch
import torch.nn.functional as F

from forja import fallbacks
from forja.eager import eager_only

GROUPED_MM_IMPLS = ("auto", "grouped", "loop")


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Reference: x (M, K) rows sorted by group, w (G, N, K), counts (G,) -> (M, N)."""
    sizes = counts.tolist()
    # unbind, not w[g]: each w[g]'s backward would make a zero tensor the size of all of w
    # (G of them: 93x slower at 128 experts, bench/RESULTS.md); unbind's stacks one.
    weights = w.unbind(0)
    out = [F.linear(rows, weights[g]) for g, rows in enumerate(x.split(sizes)) if sizes[g]]
    if not out:  # no rows at all: still an output in the graph of x and w (zero gradients)
        return F.linear(x, w[0])
    return torch.cat(out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `_grouped_mm`'s backward
    rejects the zero-stride gradient that, for instance, `out.sum()` produces."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def row_alignment(x: torch.Tensor) -> int:
    """Rows each group's start is padded to a multiple of: 16 bytes' worth on CUDA (8 in bf16,
    16 in float8), 1 (no padding) elsewhere: the CPU kernel reads any group start."""
    return 16 // x.element_size() if x.device.type == "cuda" else 1


def padded_groups(counts: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where `rows` rows sorted by group go when each group starts at a multiple of `align`.

    counts (G,) int, summing to `rows` -> index (rows,) int64, the padded row of each real row;
    ends (G,) int32, each padded group's end (its length rounded up to `align`), the offsets
    for `torch._grouped_mm`; and the padded row count, rows + G * (align - 1), a bound that
    holds for any counts (rows past ends[-1] belong to no group and are never read)."""
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align  # (G,)
    ends = torch.cumsum(padded, 0)  # (G,)
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)  # (G,) padded start - real start
    group = torch.arange(counts.shape[0], device=counts.device).repeat_interleave(counts, output_size=rows)  # (rows,)
    index = torch.arange(rows, device=counts.device) + shift[group]  # (rows,)
    return index, ends.to(torch.int32), rows + counts.shape[0] * (align - 1)


def pad_groups(x: torch.Tensor, index: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """x (rows, K) -> (padded_rows, K): row i at index[i], zeros elsewhere (differentiable)."""
    return x.new_zeros(padded_rows, x.shape[-1]).index_copy(0, index, x)


def unpad_groups(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """y (padded_rows, N) -> (rows, N): the real rows back, in their order (differentiable)."""
    return y.index_select(0, index)


def grouped_mm_fused(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, align: int | None = None) -> torch.Tensor:
    """`torch._grouped_mm` with group ends as int32 offsets; with `align` > 1 (default
    `row_alignment(x)`) on a padded copy of x whose groups start at multiples of it."""
    align = row_alignment(x) if align is None else align
    if align == 1:
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # (G,) end row of each group
        return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
    index, ends, padded_rows = padded_groups(counts, x.shape[0], align)
    out = torch._grouped_mm(pad_groups(x, index, padded_rows), w.transpose(-2, -1), offs=ends)  # (P, N)
    return _ContiguousGrad.apply(unpad_groups(out, index))  # (M, N)


@cache
def _grouped_supported(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda":
        return capability is not None and capability >= (9, 0) and dtype == torch.bfloat16
    if device_type != "cpu":
        return False
    # Older torch has no CPU kernel: probe once, in the dtype asked about, on a thread of its own.
    # The first forward asks, and its thread may be inside autocast, a fake-tensor mode or
    # selective checkpointing, which would count the probe as one of the forward's matmuls and
    # hand its output to the recomputation (each is thread-local; a new thread has none).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_probe_cpu_kernel, dtype).result()


def _probe_cpu_kernel(dtype: torch.dtype) -> bool:
    x, w = torch.ones(32, 16, dtype=dtype), torch.ones(2, 16, 16, dtype=dtype)  # 16-byte aligned groups of 16 rows
    try:
        grouped_mm_fused(x, w, torch.tensor([16, 16]))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `x` runs in: autocast's where it is on for x's device."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.is_floating_point():
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def grouped_supported(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether `torch._grouped_mm` runs for these tensors (device, alignment) computed in
    `dtype` (default: x's dtype)."""
    dtype = dtype or x.dtype
    if torch.compiler.is_compiling() and x.device.type != "cuda":
        return False  # the op's meta function (what compile traces with) accepts bf16 CUDA inputs only
    cap = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
    size = torch.empty((), dtype=dtype).element_size()
    aligned = all(s * size % 16 == 0 for s in (x.shape[-1], w.shape[-2]))
    return aligned and _grouped_supported(x.device.type, dtype, cap)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (M, K) rows sorted by group, w (G, N, K), counts (G,) int -> (M, N)."""
    if impl == "loop":
        return grouped_mm_loop(x, w, counts)
    dtype = compute_dtype(x)
    if grouped_supported(x, w, dtype):
        return grouped_mm_fused(x.to(dtype), w.to(dtype), counts)
    if impl == "grouped":
        _record_loop(x, w, dtype)
    return grouped_mm_loop(x, w, counts)


@eager_only  # a host-side record, once per process: not part of any graph
def _record_loop(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> None:
    fallbacks.record(
        "ops.grouped_mm", asked="model.overrides.moe_impl = 'grouped'", instead="a per-expert loop of F.linear",
        why=f"torch._grouped_mm does not run on {x.device.type} in {str(dtype).removeprefix('torch.')} with "
            f"widths {x.shape[-1]} and {w.shape[-2]}: it runs in bf16 on CUDA GPUs of capability >= 9.0, on "
            "CPUs where this torch has a kernel for the dtype, and with 16-byte aligned rows",
        fix="train in bf16 (autocast) on a Hopper-or-later GPU, or set moe_impl = 'auto' to take the loop silently")
