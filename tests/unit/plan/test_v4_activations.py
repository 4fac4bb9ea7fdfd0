"""The memory model's DeepSeek-V4 block (forja/plan/v4_activations.py) against the tensors a
debug block really keeps, for each kind of attention, in fp32 and under bf16 autocast:
everything autograd saves without activation checkpointing, and what op-level selective AC
keeps (the matmuls' outputs: the merges' streams and the written-out scores most of them)."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.models import build_from_args, model_args
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations, weight_casts
from forja.plan.shape import model_shape
from tests.unit.plan.kept import kept_by_checkpoint
from tests.unit.plan.test_shape_activations import saved_bytes

B, T = 2, 64
KINDS = {"heavily_compressed_attention": 0, "compressed_sparse_attention": 1, "sliding_attention": 2}


@functools.cache
def _model():
    return build_from_args(model_args("deepseek_v4", "debug", n_hash_layers=0))  # top-k routed: no token ids


def _inputs(kind: str):
    model = _model()
    streams = torch.randn(B, T, model.args.hc_mult, model.args.dim, requires_grad=True,
                          generator=torch.Generator().manual_seed(0))
    mask = model.mask_for(kind, None, T, 0, streams.device)
    mask.positions = torch.arange(T)
    return streams, model.rope_tables_for(kind, torch.arange(T)), mask


def _predicted_and_actual(kind: str, bf16: bool, ac: str) -> tuple[float, int]:
    model, layer = _model(), KINDS[kind]
    block, (streams, rope, mask) = model.layers[str(layer)], _inputs(kind)
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=bf16)
    shape = job.shape.blocks[layer]
    assert shape.kind == kind
    lay = Layout(micro_batch_size=B, ac=ac)
    kept, _ = block_activations(job, lay, shape, layer)
    if ac == "none":
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            actual = saved_bytes(block, streams, rope, mask)
        return kept * B * T + weight_casts(job, lay, shape, layer), actual
    kept -= model.args.hc_mult * model.args.dim * 4  # the input streams, which AC keeps but the block did not make
    return kept * B * T, kept_by_checkpoint(block, (streams, rope, mask), bf16=bf16)


# Measured predicted / saved (HCA, CSA, sliding): fp32 0.995, 0.995, 0.995; bf16 0.996, 1.007,
# 0.996. Op-level AC: fp32 0.995 each, bf16 0.990, 0.990, 0.989 (the rotary tables and a mask row
# it also keeps are left out of the count).
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_v4_block_saves_what_the_planner_counts(kind, bf16):
    predicted, actual = _predicted_and_actual(kind, bf16, "none")
    print(f"{kind} {'bf16' if bf16 else 'fp32'}: predicted / saved {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.03)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_op_level_ac_keeps_the_v4_blocks_matmul_outputs(kind, bf16):
    predicted, actual = _predicted_and_actual(kind, bf16, "selective")
    print(f"{kind} {'bf16' if bf16 else 'fp32'} op-level: predicted / kept {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)
