"""The memory model's Kimi Delta Attention block (forja/plan/kda_activations.py) against the
tensors Kimi Linear's debug KDA blocks (0 dense, 1 and 2 mixtures of experts) really keep:
everything autograd saves without activation checkpointing, and what op-level selective AC
keeps (the projections' and the chunked rule's batched matmuls' outputs), in fp32 at lengths
of whole chunks of 16, a padded last chunk and one padded chunk.

Under bf16 autocast the PyTorch reference cannot run on a CPU (its triangular solve has no
bf16 kernel), so that count is checked on fake tensors, which run the same autograd graph
without computing (as forja's rehearsal does); block 0 only, as the experts' routing needs
real token counts."""

from __future__ import annotations

import functools

import pytest
import torch

from forja.models import build_from_args, model_args
from forja.plan.activations import attention_saved, widths
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations, weight_casts
from forja.plan.shape import model_shape
from tests.unit.plan.kept import kept_by_checkpoint, saved_through_aliases

B = 2
LENGTHS = [64, 56, 12]  # four whole chunks, a padded last chunk, one padded chunk


@functools.cache
def _model():
    return build_from_args(model_args("kimi_linear", "debug"))


def _setting(layer: int, T: int, bf16: bool, ac: str):
    model = _model()
    h = torch.randn(B, T, model.args.dim, requires_grad=True, generator=torch.Generator().manual_seed(0))
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=bf16)
    shape = job.shape.blocks[layer]
    assert shape.kind == "linear_attention"
    return model.layers[str(layer)], h, model.mask_for("linear_attention", None, T, 0, h.device), job, shape, \
        Layout(micro_batch_size=B, ac=ac)


def _predicted_and_actual(layer: int, T: int, bf16: bool, ac: str) -> tuple[float, int]:
    """(the planner's bytes for the whole block, what it saves, or under op-level AC keeps)."""
    block, h, mask, job, shape, lay = _setting(layer, T, bf16, ac)
    kept, _ = block_activations(job, lay, shape, layer)
    if ac == "none":
        saved = saved_through_aliases(block, h, None, mask, fake=bf16, bf16=bf16)
        return kept * B * T + weight_casts(job, lay, shape, layer), saved
    kept -= h.shape[-1] * 4  # the block's fp32 input, which AC keeps but the block did not make
    return kept * B * T, kept_by_checkpoint(block, (h, None, mask), bf16=bf16)


def _mixer_under_op_level_ac(layer: int, T: int) -> tuple[float, int]:
    """(the planner's matmul outputs of the block's KDA mixer, what op-level AC keeps of the mixer
    alone, run on its pre-norm's output: its own output, wo's, aside on both sides), in fp32."""
    block, h, mask, job, shape, lay = _setting(layer, T, False, "selective")
    x = block.attention_norm(h).detach().requires_grad_()
    matmuls = attention_saved(job, lay, shape, widths(job))[1] - x.shape[-1] * 4  # the mixer's own output aside
    return matmuls * B * T, kept_by_checkpoint(block.attention, (x, None, mask))


# Measured predicted / saved in fp32, blocks 0, 1, 2 (block 0 a dense SwiGLU, 1 and 2 experts):
# T 64 1.000 each (priced as Gated DeltaNet before this count: 0.573, 0.575, 0.575); T 56, a
# padded last chunk, 1.000 each; T 12, one padded chunk, 0.999, 1.000, 1.000. Under bf16 autocast
# on fake tensors, block 0: 1.000 at each length.
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_a_kda_block_saves_what_the_planner_counts(layer, T):
    predicted, actual = _predicted_and_actual(layer, T, bf16=False, ac="none")
    print(f"KDA block {layer} T {T} fp32: predicted / saved {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)


@pytest.mark.parametrize("T", LENGTHS)
def test_a_kda_block_under_bf16_autocast_on_fake_tensors(T):
    predicted, actual = _predicted_and_actual(0, T, bf16=True, ac="none")
    print(f"KDA block 0 T {T} bf16 (fake): predicted / saved {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)


# Op-level AC, fp32, measured: the KDA mixer of blocks 0, 1, 2 1.000 at each length; the whole
# dense block 0 1.000 at each. (The whole blocks 1 and 2 gave 0.919-0.924 while the mixture of
# experts' count left out the shared expert's w2 output and the router's logits; at T 64 they
# are 1.000 now, test_moe_op_level.py.)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_op_level_ac_keeps_the_kda_mixers_matmul_outputs(layer, T):
    predicted, actual = _mixer_under_op_level_ac(layer, T)
    print(f"KDA mixer {layer} T {T} fp32 op-level: predicted / kept {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)


@pytest.mark.parametrize("T", LENGTHS)
def test_op_level_ac_keeps_a_dense_kda_blocks_matmul_outputs(T):
    predicted, actual = _predicted_and_actual(0, T, bf16=False, ac="selective")
    print(f"KDA block 0 T {T} fp32 op-level: predicted / kept {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.05)
