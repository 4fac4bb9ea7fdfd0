"""Fused kernels: one file per op, each with its Triton kernels, its PyTorch reference and
the dispatch between them (`dispatch.py`: Triton on CUDA when triton imports, the reference
otherwise, `FORJA_OPS=reference|triton` to force one).

    rms_norm(x, weight, eps)            forja.models.common.norms.RMSNorm
    rope(q, k, cos, sin) -> (q, k)      forja.ops.rope.apply_rope on q and on k
    swiglu(gate, up)                    F.silu(gate) * up
    fused_linear_cross_entropy(...)     see forja.ops.cross_entropy
"""

from __future__ import annotations

from forja.ops.dispatch import triton_available, use_triton
from forja.ops.names import FUSED_OPS
from forja.ops.rms_norm import rms_norm
from forja.ops.rope import rope
from forja.ops.swiglu import swiglu

__all__ = ["FUSED_OPS", "fused_linear_cross_entropy", "rms_norm", "rope", "swiglu",
           "triton_available", "use_triton"]


def __getattr__(name: str):
    # Imported on first use: cross_entropy.py is its own piece of work and may be absent.
    if name == "fused_linear_cross_entropy":
        from forja.ops.cross_entropy import fused_linear_cross_entropy

        return fused_linear_cross_entropy
    raise AttributeError(f"module 'forja.ops' has no attribute {name!r}")
