"""The memory model's Gemma 4 blocks (forja/plan/gemma4_activations.py) against the tensors a debug
block really keeps, run as the model runs it (per-layer input, the forward's shared keys and
values): everything autograd saves without activation checkpointing, and what op-level selective
AC keeps (the matmuls' and attention's outputs), in fp32 and under bf16 autocast; and the
per-layer inputs the model keeps before its first block."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch

from forja.models import build_from_args, model_args
from forja.models.gemma4.attention import SharedKV
from forja.plan.gemma4_activations import per_layer_inputs_saved
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations, weight_casts
from forja.plan.shape import model_shape
from tests.unit.plan.kept import kept_by_checkpoint

B, T = 2, 64
# (flavor and overrides, layer): the debug flavors' blocks are sliding, sliding, full, sliding,
# sliding, full; the last two share the keys and values of blocks 3 and 2 (with a double-wide
# GeGLU). The last case widens what the debug sizes make small: the per-layer input (16 -> 128)
# and the slots a token fills (top-k 2 -> 4).
WIDE = (("ple_dim", 128), ("top_k", 4))
BLOCKS = {"local": ("debug", 0), "global": ("debug", 2), "kv-shared local": ("debug", 4),
          "kv-shared global": ("debug", 5), "moe": ("debug-moe", 0), "moe global": ("debug-moe", 2),
          "moe, wide per-layer input": (("debug-moe", *WIDE), 0)}


@functools.cache
def _model(flavor: str | tuple):
    """The flavor, or (flavor, *overrides as pairs), built once for the file."""
    name, *overrides = (flavor,) if isinstance(flavor, str) else flavor
    torch.manual_seed(0)
    return build_from_args(model_args("gemma4", name, **dict(overrides)))


def _inputs(flavor: str | tuple, layer: int, bf16: bool):
    """What block `layer` receives in the model's forward (Gemma4.forward): its input h (a leaf
    that takes gradients), rotary tables and mask of its kind, and as keywords its slice of the
    per-layer inputs (trained: they take gradients too) and the keys and values the earlier
    blocks handed on, those blocks run without gradients."""
    model = _model(flavor)
    tokens = torch.randint(0, model.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    positions, kind = torch.arange(T), model.args.layer_type(layer)
    shared = SharedKV()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        h = model.add_positions(model.tok_embeddings(tokens), positions)
        per_layer = model.per_layer_inputs(tokens, h)  # (B, T, L, P)
        for i in range(layer):
            k = model.args.layer_type(i)
            h = model.layers[str(i)](h, model.rope_tables_for(k, positions), model.mask_for(k, None, T, 0, h.device),
                                     None, i, per_layer=per_layer[:, :, i], shared=shared)
    per_layer = per_layer.float().requires_grad_()
    args = (h.float().requires_grad_(), model.rope_tables_for(kind, positions),
            model.mask_for(kind, None, T, 0, h.device), None, layer)
    return args, {"per_layer": per_layer[:, :, layer], "shared": shared}


def _made_before(args, kwargs) -> set[int]:
    """Storages the block did not make: the rotary tables (the model's, per position, shared by
    the batch and by every block of a kind), the per-layer inputs (the model's, priced apart)
    and the keys and values a producer hands on (its attention keeps them)."""
    tensors = [*args[1], kwargs["per_layer"], *(t for kv in kwargs["shared"].by_kind.values() for t in kv)]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _saved_by_autograd(block, args, kwargs, bf16: bool) -> int:
    """Bytes of the distinct storages autograd saves in the block's forward and still holds when
    it returns (its parameters, per-layer input and borrowed keys and values aside)."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | _made_before(args, kwargs)
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = block(*args, **kwargs)  # held: its graph holds what backward would read
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for ref in packed
            if (t := ref()) is not None and t.untyped_storage().data_ptr() not in skip}
    del out
    return sum(seen.values())


def predicted_and_actual(name: str, bf16: bool, ac: str) -> tuple[float, int]:
    """(the planner's bytes for the block at B 2, T 64 on a CPU, what the block keeps)."""
    flavor, layer = BLOCKS[name]
    model = _model(flavor)
    block, (args, kwargs) = model.layers[str(layer)], _inputs(flavor, layer, bf16)
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=bf16)
    shape, lay = job.shape.blocks[layer], Layout(micro_batch_size=B, ac=ac)
    assert shape.kind == model.args.layer_type(layer) and shape.gemma4
    kept, _ = block_activations(job, lay, shape, layer)
    if ac == "none":  # the weights' bf16 casts under autocast are priced per block (weight_casts)
        return kept * B * T + weight_casts(job, lay, shape, layer), _saved_by_autograd(block, args, kwargs, bf16)
    kept -= model.args.dim * 4  # the block's input, which AC keeps but the block did not make
    return kept * B * T, kept_by_checkpoint(block, args, kwargs, bf16=bf16, skip=lambda: _made_before(args, kwargs))


# Measured predicted / saved (local, global, kv-shared local, kv-shared global, moe, moe global,
# wide): fp32 0.999 each; bf16 1.004, 0.999, 1.004, 0.999, 1.003, 1.000, 1.002. Before Gemma 4's
# own count (every block priced with the model's heads and GeGLU): fp32 0.854, 0.777, 0.779,
# 0.695, 0.593, 0.556, 0.634; bf16 0.883, 0.821, 0.893, 0.823, 0.701, 0.673, 0.726. Within 3%
# (the ratios are shapes', deterministic): each term of the count but two fails some case when
# broken (in bf16, the two output norms' fp32 joins, 1.7% of an MoE block, and a shared block's
# cast of its producer's keys, 1.4%, do not).
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_gemma4_block_saves_what_the_planner_counts(name, bf16):
    predicted, actual = predicted_and_actual(name, bf16, "none")
    print(f"{name} {'bf16' if bf16 else 'fp32'}: predicted / saved {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.03)


# Measured op-level AC predicted / kept: 1.000 for each block, fp32 and bf16 (before: fp32 0.899,
# 0.825, 0.762, 0.662, 0.593, 0.557, 0.648; bf16 alike within 0.001).
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_op_level_ac_keeps_the_gemma4_blocks_matmul_outputs(name, bf16):
    predicted, actual = predicted_and_actual(name, bf16, "selective")
    print(f"{name} {'bf16' if bf16 else 'fp32'} op-level: predicted / kept {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.02)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_per_layer_inputs_keep_what_the_planner_counts(bf16):
    """The per-layer inputs, made once before the first block from the token ids and the embedded
    tokens, and read by every block: their norm's input, statistics and output, the inputs
    themselves (held here as the blocks hold them), the projection's input cast under autocast
    (measured 1.000 in fp32 and bf16)."""
    model = _model("debug")
    tokens = torch.randint(0, model.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    h = model.add_positions(model.tok_embeddings(tokens), torch.arange(T)).detach().requires_grad_()
    made_before = [*model.parameters(), h, tokens]  # the embedding's saved ids are the step's input
    params = {t.untyped_storage().data_ptr() for t in made_before}
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        per_layer = model.per_layer_inputs(tokens, h)
    held = [per_layer] + [t for ref in packed if (t := ref()) is not None]
    actual = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held
                  if t.untyped_storage().data_ptr() not in params}.values())
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=bf16)
    predicted = per_layer_inputs_saved(job, Layout(micro_batch_size=B)) * B * T
    # The projection's bf16 weight cast under autocast, once a step: the planner prices the
    # blocks' weight casts (weight_casts), not the root's (this one, the output projection's).
    predicted += model.ple_projection.weight.numel() * 2 if bf16 else 0
    print(f"{'bf16' if bf16 else 'fp32'}: predicted / kept {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)
