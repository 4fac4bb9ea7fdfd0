"""What op-level selective activation checkpointing keeps of one block's forward, measured: the
storages the forward made (seen op by op) that outlive it. Shared by the planner's block tests
(test_mamba2_activations.py, test_v4_activations.py, test_kda_activations.py,
test_gemma4_activations.py, test_latent_activations.py, test_moe_op_level.py), each pricing its
kinds against it; and what a block's forward saves for backward without checkpointing, through
aliases (`saved_through_aliases`)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from forja.models.common.moe import moe_layers
from forja.parallel.ac import CheckpointedBlock
from forja.plan.activations import ffn_saved, widths
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations
from forja.plan.shape import model_shape
from tests.unit.plan.test_shape_activations import block_inputs, built


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


def saved_through_aliases(block: torch.nn.Module, h: torch.Tensor, *rest, fake: bool, bf16: bool,
                          within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> int:
    """Bytes of the distinct storages autograd saves in `block(h, *rest)`'s forward and still
    holds when it returns (parameters excluded), on fake tensors with `fake`, under bf16 autocast
    with `bf16`, inside `within()` (a kernel's stand-in). The hook hands autograd a detached alias:
    the tensor itself would make an output its own node saves (exp's, sigmoid's) hold that node,
    keeping a branch nothing reads alive."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    to_mode = mode.from_tensor if fake else (lambda t: t)
    params = [to_mode(p) for p in block.parameters()]  # held: their storages stay theirs
    skip = {p.untyped_storage()._cdata for p in params}
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alias = t.detach()
        packed.append(weakref.ref(alias))
        return alias

    with mode, within(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(to_mode(h), *rest)  # held: its graph holds what backward would read
        storages = [t.untyped_storage() for ref in packed if (t := ref()) is not None]
        kept = {s._cdata: s.nbytes() for s in storages if s._cdata not in skip}
    del out
    return sum(kept.values())


def moe_records(model: torch.nn.Module) -> set[int]:
    """Storages of the statistics each MoE layer records per training forward (`MoE._records`,
    held for the step engine to read): no activation, left out of what AC keeps."""
    return {t.untyped_storage().data_ptr() for _, layer in moe_layers(model) for record in layer._records
            for t in record if isinstance(t, torch.Tensor)}


def block_under_op_level_ac(family: str, flavor: str, layer: str, bf16: bool, part: str = "", T: int = 64,
                            **overrides) -> tuple[float, int]:
    """(the planner's bytes op-level AC keeps of one block at B 2, T tokens on a CPU, what it
    keeps), of the flavor with `overrides`; with `part` = "feed_forward" that sublayer alone (its
    matmul outputs), run on a random input."""
    model = built(family, flavor, tuple(sorted(overrides.items())))
    B = 2
    h, rope, mask = block_inputs(model, layer, B, T)
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=bf16)
    shape, lay = job.shape.blocks[int(layer)], Layout(micro_batch_size=B, ac="selective")
    block = model.layers[layer]
    if part == "feed_forward":
        _, matmuls = ffn_saved(job, lay, shape, widths(job))
        kept = kept_by_checkpoint(block.feed_forward, (h,), bf16=bf16, skip=lambda: moe_records(model))
        return matmuls * B * T, kept
    predicted, _ = block_activations(job, lay, shape, int(layer))
    predicted -= model.args.dim * 4  # the block's fp32 input, which AC keeps but the block did not make
    kept = kept_by_checkpoint(block, (h, rope, mask), bf16=bf16, skip=lambda: moe_records(model))
    return predicted * B * T, kept
