"""Which implementation of a fused op runs: the Triton kernel or the PyTorch reference.

The rule: Triton when every tensor is a plain CUDA tensor and triton imports; the reference
otherwise (CPU, DTensors, no triton). The environment variable `FORJA_OPS` overrides it:

- `FORJA_OPS=reference` forces the reference everywhere (to rule a kernel out when debugging);
- `FORJA_OPS=triton` forces the kernels even on CPU tensors. Only Triton's interpreter
  (`TRITON_INTERPRET=1`) can run kernels on CPU tensors; this is how the kernels are tested
  on machines without a GPU.

`TRITON_INTERPRET=1` must be in the environment before triton is first imported: Triton
decides when it jits a function (its own `tl.sum` included, at `import triton`) whether
it builds a compiled or an interpreted kernel. Tests therefore run the interpreter in a
fresh process (tests/unit/ops/interpret_checks.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from forja.errors import ForjaError

OPS_ENV = "FORJA_OPS"
OPS_MODES = ("auto", "reference", "triton")
MAX_ROW = 65536
"""Longest row (last dimension) the row kernels hold in one block."""

_triton_ok: bool | None = None
_jitted_interpreted: bool | None = None  # TRITON_INTERPRET when forja's kernels were jitted
_sm_counts: dict[int, int] = {}


def triton_available() -> bool:
    """True when `import triton` works; checked once per process."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _triton_ok = True
        except Exception:  # an ImportError, or a triton that fails while loading its backends
            _triton_ok = False
    return _triton_ok


def interpreting() -> bool:
    """True when Triton's interpreter is asked for (kernels then run on CPU tensors)."""
    # The spellings Triton itself accepts for a true flag.
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def ops_mode() -> str:
    """The value of FORJA_OPS: "auto" (unset), "reference" or "triton"."""
    mode = os.environ.get(OPS_ENV, "auto").strip().lower() or "auto"
    if mode not in OPS_MODES:
        raise ForjaError(f"{OPS_ENV}={mode!r} is not understood; use one of {', '.join(OPS_MODES)} "
                         f"or leave it unset")
    return mode


def _is_plain(t: torch.Tensor) -> bool:
    # A DTensor (tensor/sequence parallel) has no single storage a kernel could address; the
    # reference runs on it through DTensor's own op rules.
    return not hasattr(t, "placements")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops should run their Triton kernels on these tensors."""
    mode = ops_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        if not triton_available():
            raise ForjaError(f"{OPS_ENV}=triton but triton does not import; install triton or unset {OPS_ENV}")
        if not all(t.is_cuda for t in tensors) and not (interpreting() and _jitted_interpreted):
            raise ForjaError(f"{OPS_ENV}=triton on CPU tensors needs Triton's interpreter: set "
                             f"TRITON_INTERPRET=1 in the environment the process starts with, or unset {OPS_ENV}")
        return True
    return all(t.is_cuda and _is_plain(t) for t in tensors) and triton_available()


def jit(fn: Callable) -> Callable:
    """`triton.jit(fn)` when triton imports; else `fn` itself, which is then never launched."""
    global _jitted_interpreted
    if not triton_available():
        return fn
    import triton

    _jitted_interpreted = interpreting()
    return triton.jit(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_block(n_cols: int, what: str) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that holds one row of `n_cols` elements per program."""
    if n_cols > MAX_ROW:
        raise ForjaError(f"{what}: rows of {n_cols} elements exceed the {MAX_ROW} a fused kernel holds; "
                         f"set FORJA_OPS=reference or turn the fused ops off")
    block = next_power_of_2(n_cols)
    # More warps for longer rows keep the elements per thread (registers) bounded.
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def program_count(device: torch.device, n_rows: int) -> int:
    """Programs for a kernel that loops over rows: four per SM on CUDA (an SM holds several
    programs, which hides memory latency; each also writes one partial sum, so not more),
    a few when interpreted."""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(n_rows, 4 * _sm_counts[index]))
