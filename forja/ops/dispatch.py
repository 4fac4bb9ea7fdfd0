"""Which implementation of a fused op runs: the Triton kernel or the PyTorch reference.

The rule: Triton when every tensor is a plain CUDA tensor and triton imports; the reference
otherwise (CPU, DTensors, no triton). The environment variable `FORJA_OPS` overrides it:

- `FORJA_OPS=reference` forces the reference everywhere (to rule a kernel out when debugging);
- `FORJA_OPS=triton` forces the kernels even on CPU tensors. Only Triton's interpreter
  (`TRITON_INTERPRET=1`) can run kernels on CPU tensors; this is how the kernels are tested
  on machines without a GPU.

Fallbacks: a fused op that does not run its kernel where the rule above promised it (CUDA
tensors but no triton, `FORJA_OPS=reference` on CUDA, inputs a kernel cannot take) records
it once in forja's fallback record (`forja/fallbacks.py`): the trainer prints one line and
keeps it in run.json. CPU tensors without the interpreter take the reference by the rule
itself: that is no fallback. DTensors (tensor and sequence parallelism) are handed to the
kernels as their local shards where the op allows it (`local_shards`).

`TRITON_INTERPRET=1` must be in the environment before triton is first imported: Triton
decides when it jits a function (its own `tl.sum` included, at `import triton`) whether
it builds a compiled or an interpreted kernel. Tests therefore run the interpreter in a
fresh process (tests/unit/ops/interpret_checks.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # no public name for it
from torch.distributed.tensor import DTensor, Partial, Shard

from forja import fallbacks
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
    # A DTensor has no single storage a kernel could address: the op hands over its local shard
    # (`local_shards`) or, where it cannot, runs the reference through DTensor's own op rules.
    return not isinstance(t, DTensor)


_INSTEAD = {"cross_entropy": "the per-chunk softmax in PyTorch (still chunked, no logits kept)"}


def record_fallback(op: str, why: str, *, fix: str = "") -> None:
    """Record that fused op `op` runs without its Triton kernel, and why."""
    asked = "FORJA_OPS=triton" if ops_mode() == "triton" else f"model.fused_ops ({op})"
    instead = _INSTEAD.get(op, f"the PyTorch reference of {op}")
    fallbacks.record(f"ops.{op}", asked=asked, instead=instead, why=why, fix=fix)


def kernel_promised(*tensors: torch.Tensor) -> bool:
    """Whether the rule promises the kernels for tensors on these devices (FORJA_OPS=triton, or
    CUDA when not forced to the reference): the reference running there instead is a fallback."""
    mode = ops_mode()
    return mode == "triton" or (mode == "auto" and all(t.is_cuda for t in tensors))


def use_triton(*tensors: torch.Tensor, op: str | None = None) -> bool:
    """Whether the fused ops should run their Triton kernels on these tensors. With `op` (the
    op's name), a kernel the rule promised but that cannot run is recorded as a fallback."""
    mode = ops_mode()
    on_cuda = all(t.is_cuda for t in tensors)
    if mode == "reference":
        if op is not None and on_cuda:  # on CPU the reference is what auto picks anyway
            record_fallback(op, f"{OPS_ENV}=reference forces it", fix=f"unset {OPS_ENV}")
        return False
    plain = all(_is_plain(t) for t in tensors)
    if mode == "triton":
        if not triton_available():
            raise ForjaError(f"{OPS_ENV}=triton but triton does not import; install triton or unset {OPS_ENV}")
        if not on_cuda and not (interpreting() and _jitted_interpreted):
            raise ForjaError(f"{OPS_ENV}=triton on CPU tensors needs Triton's interpreter: set "
                             f"TRITON_INTERPRET=1 in the environment the process starts with, or unset {OPS_ENV}")
        if not plain and op is not None:
            record_fallback(op, _dtensor_why(tensors))
        return plain
    if not on_cuda:
        return False
    if not triton_available():
        if op is not None:
            record_fallback(op, "triton does not import", fix="install triton (pip install triton)")
        return False
    if not plain:
        if op is not None:
            record_fallback(op, _dtensor_why(tensors))
        return False
    return True


def _dtensor_why(tensors: tuple[torch.Tensor, ...]) -> str:
    placements = [tuple(t.placements) for t in tensors if isinstance(t, DTensor)]
    return f"its DTensor inputs (placements {placements}) have no local shard the kernel can take"


def local_shards(tensors: tuple[torch.Tensor | None, ...], *, keep_dims: tuple[int, ...]
                 ) -> tuple[list[torch.Tensor | None], DTensor] | None:
    """The local shards of DTensor inputs to a fused op that computes each element from its own
    row or position (RMSNorm over the last dimension, SwiGLU, RoPE per token and head), so that
    each rank runs the kernel on its shard: (plain tensors, the first DTensor input, whose mesh
    and placements the output takes with `as_output`). None when they cannot be taken: tensors
    on different meshes, a Partial value, or a tensor split along one of `keep_dims` (dims of
    the first tensor the op needs whole, e.g. the normalized dimension; negative from the end).

    `tensors[0]` is the activation; the others are either shaped like it with the same
    placements, or parameters/tables replicated on the mesh (plain tensors: the same on every
    rank). Autograd flows through `to_local`: an activation's gradient is its local shard's; a
    replicated parameter's gradient is a partial sum wherever the activation is sharded (each
    rank saw some rows), which DTensor reduces as it does for the reference's own ops."""
    first = tensors[0]
    if not isinstance(first, DTensor):
        return None
    mesh, placements = first.device_mesh, tuple(first.placements)
    keep = {d % first.ndim for d in keep_dims}
    if any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim % first.ndim in keep) for p in placements):
        return None
    # Per mesh dimension: the activation is split there (a parameter's gradient is partial) or not.
    grad_of_replicated = [Partial() if isinstance(p, Shard) else p for p in placements]
    out: list[torch.Tensor | None] = []
    for t in tensors:
        if not isinstance(t, DTensor):
            out.append(t)
        elif t.device_mesh != mesh:
            return None
        elif t.shape == first.shape:  # another activation: it must be split as the first one is
            if tuple(t.placements) != placements:
                return None
            out.append(t.to_local())
        elif all(p.is_replicate() for p in t.placements):
            out.append(t.to_local(grad_placements=grad_of_replicated))
        else:
            return None
    return out, first


def waited(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` as a tensor a kernel can address. A DTensor's local shard, or the gradient DTensor
    hands back, may be the result of a collective not yet waited for (torch's
    AsyncCollectiveTensor, a wrapper without storage of its own): wait for it. For use inside
    an autograd Function's forward and backward, where no graph is being recorded."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def as_output(local: torch.Tensor, like: DTensor) -> DTensor:
    """A kernel's output on the local shard of `like`, as a DTensor laid out like it (the
    global shape is `like`'s; the output is contiguous)."""
    stride, step = [], 1
    for size in reversed(like.shape):  # a contiguous tensor's strides
        stride.insert(0, step)
        step *= max(size, 1)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=tuple(stride))


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
