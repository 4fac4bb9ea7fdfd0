"""The memory model's Mamba-2 block (forja/plan/activations.py `mamba2_saved`, `ssd_scan_saved`)
against the tensors a Nemotron-H debug block really keeps, in fp32 and under bf16 autocast:
everything autograd saves without activation checkpointing, and what op-level selective AC
keeps (the projections' outputs and the chunked scan's batched matmuls': at 4,096 tokens the
scan's (C x C) scores, outputs and per-chunk states are most of a Nemotron-H rank's peak).
The chunk sizes cover several chunks, a padded last chunk and one padded chunk."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_from_args, model_args
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations, weight_casts
from forja.plan.shape import model_shape
from tests.unit.plan.kept import kept_by_checkpoint
from tests.unit.plan.test_shape_activations import saved_bytes

B = 2
# (tokens, chunk): two chunks, four chunks, a padded last chunk, one padded chunk.
SIZES = [(64, 32), (64, 16), (48, 32), (64, 128)]


def _predicted_and_actual(T: int, chunk: int, bf16: bool, ac: str) -> tuple[float, int]:
    torch.manual_seed(0)
    args = model_args("nemotron_h", "debug", mamba_chunk_size=chunk)
    block = build_from_args(args).layers["0"]
    h = torch.randn(B, T, args.dim, requires_grad=True)
    job = Job(shape=model_shape(args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=bf16)
    shape = job.shape.blocks[0]
    assert shape.kind == "mamba2" and shape.mamba2[-1] == chunk
    lay = Layout(micro_batch_size=B, ac=ac)
    kept, _ = block_activations(job, lay, shape, 0)
    if ac == "none":
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            actual = saved_bytes(block, h, None, None)
        return kept * B * T + weight_casts(job, lay, shape, 0), actual
    kept -= args.dim * 4  # the block's fp32 input, which AC keeps but the block did not make
    return kept * B * T, kept_by_checkpoint(block, (h, None, None), bf16=bf16)


# Measured predicted / saved, fp32 and bf16: 0.999, 0.986 (two chunks); 1.000, 0.986 (four);
# 0.999, 0.984 (padded); 0.971, 0.979 (one padded chunk). Op-level AC: 1.000 in each.
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,chunk", SIZES)
def test_a_mamba2_block_saves_what_the_planner_counts(T, chunk, bf16):
    predicted, actual = _predicted_and_actual(T, chunk, bf16, "none")
    assert predicted == pytest.approx(actual, rel=0.05)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,chunk", SIZES[:3])
def test_op_level_ac_keeps_the_scans_matmul_outputs(T, chunk, bf16):
    predicted, actual = _predicted_and_actual(T, chunk, bf16, "selective")
    assert predicted == pytest.approx(actual, rel=0.02)
