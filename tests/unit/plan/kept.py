"""What op-level selective activation checkpointing keeps of one block's forward, measured: the
storages the forward made (seen op by op) that outlive it. Shared by the planner's block tests
(test_mamba2_activations.py, test_v4_activations.py, test_kda_activations.py,
test_gemma4_activations.py), each pricing its kinds against it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forja.parallel.ac import CheckpointedBlock


def kept_by_checkpoint(block: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, bf16: bool = False,
                       skip: Callable[[], set[int]] = frozenset) -> int:
    """Bytes of the storages `block(*args, **kwargs)` made under op-level AC that are still alive
    once it returns: what the policy saved. Its output, its parameters (and their views: mm's
    transposed weights), the tensors it was given and the storages `skip()` names (data_ptr;
    asked after the forward, which may have filled a record the caller holds) are left out, as
    things the block did not make."""
    made: list[weakref.ref] = []

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            made.extend(weakref.ref(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor))
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), Track():
        out = CheckpointedBlock(block, op_level=True)(*args, **(kwargs or {}))
    gc.collect()
    given = [t for t in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    left_out = {p.untyped_storage().data_ptr() for p in block.parameters()} | set(skip())
    left_out |= {t.untyped_storage().data_ptr() for t in [out, *given]}
    alive = {s.data_ptr(): s.nbytes() for ref in made if (s := ref()) is not None}
    return sum(n for ptr, n in alive.items() if ptr not in left_out)
