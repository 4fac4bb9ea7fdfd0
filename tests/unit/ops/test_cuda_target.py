"""The kernels compile for CUDA GPUs, checked on a machine without one.

The interpreter (test_kernels.py) runs kernels as numpy code and accepts things the
compiler refuses (Python ints where tensors are expected, unsupported casts...). Triton
can compile for a GPU it does not see: each kernel is lowered here to a cubin for an
A100 (sm_80) and an H100/H200 (sm_90), with the configurations the dispatch launches.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from forja.ops.dispatch import row_block  # noqa: E402
from forja.ops.rms_norm import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel  # noqa: E402
from forja.ops.rope import _rope_kernel  # noqa: E402
from forja.ops.swiglu import _swiglu_bwd_kernel, _swiglu_fwd_kernel  # noqa: E402

FLOAT32_POINTERS = {"RSTD", "DW_PART", "COS", "SIN"}


def _signature(kernel, constexprs: dict, dtype: str) -> dict:
    """Triton types of the kernel's arguments: pointers are capitalized, eps a float, the rest ints."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper():
            sig[name] = "*fp32" if name in FLOAT32_POINTERS else f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    return sig


def _launches():
    for d in (96, 2048, 16384):
        block, warps = row_block(d, "rms_norm")
        yield _rms_norm_fwd_kernel, {"BLOCK": block}, warps
        yield _rms_norm_bwd_kernel, {"BLOCK": block}, warps
    for backward in (False, True):
        yield _rope_kernel, {"BACKWARD": backward, "BLOCK_H": 32, "BLOCK_D": 32}, 4
    yield _swiglu_fwd_kernel, {"BLOCK": 1024}, 4
    yield _swiglu_bwd_kernel, {"BLOCK": 1024}, 4


@pytest.mark.parametrize("capability", [80, 90])
def test_kernels_compile_for_cuda(capability):
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip(f"triton {triton.__version__} has no ASTSource/GPUTarget to compile ahead of time")
    for kernel, constexprs, warps in _launches():
        for dtype in ("bf16", "fp32"):
            source = ASTSource(fn=kernel, signature=_signature(kernel, constexprs, dtype), constexprs=constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                      options={"num_warps": warps})
            assert compiled.asm["cubin"], (kernel.__name__, constexprs, dtype)
