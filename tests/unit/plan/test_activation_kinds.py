"""The memory model's kinds of block beyond fp32 (tests/unit/plan/test_shape_activations.py):
bf16 autocast, multi-token prediction modules, and what the run's backend changes (attention
sinks under FlexAttention or SDPA, Gated DeltaNet under fla or the PyTorch reference)."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_from_args, model_args
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations
from forja.plan.shape import model_shape
from tests.unit.plan.test_shape_activations import CASES, predicted_and_saved, saved_bytes


# Under CPU bf16 autocast over fp32 weights (train.precision = "bf16" on a CPU), measured:
# llama 0.987, 0.995; qwen3 0.980, 0.990; gpt2 1.001; qwen3_5 1.031, 0.995, 1.029; gpt_oss
# 0.986, 0.986; gemma3 0.992; olmo3 1.041; olmo_hybrid 1.026, 1.045; qwen3_next 1.029; nemotron_h
# 0.986, 1.000, 0.999, 1.003; llama4 0.993, 0.976.
@pytest.mark.parametrize("family,flavor,layer", CASES)
def test_block_activations_under_bf16_autocast(family, flavor, layer):
    predicted, actual = predicted_and_saved(family, flavor, layer, bf16=True)
    assert predicted == pytest.approx(actual, rel=0.05)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_a_multi_token_prediction_module_saves_what_the_planner_counts(family):
    """Its block, its two input norms, the concatenation its projection reads and its final
    norm (measured 0.985 and 0.995)."""
    args = model_args(family, "debug", mtp_depth=1)
    model = build_from_args(args)
    B, T = 2, 64
    torch.manual_seed(0)
    h = torch.randn(B, T, args.dim, requires_grad=True)  # the main model's last hidden states
    emb = model.tok_embeddings(torch.randint(0, args.vocab_size, (B, T)))
    module = next(iter(model.mtp.layers.values()))

    class WithEmbeddings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = module

        def forward(self, x, rope, mask):
            return self.module(x, emb, rope, mask)

    positions = torch.arange(T)
    actual = saved_bytes(WithEmbeddings(), h, model.rope_tables_for("full_attention", positions),
                         model.mask_for("full_attention", None, T, 0, torch.device("cpu")))
    job = Job(shape=model_shape(args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=False)
    block = job.shape.blocks[args.n_layers]
    assert block.mtp and len(job.shape.blocks) == args.n_layers + 1
    predicted, _ = block_activations(job, Layout(micro_batch_size=B), block, args.n_layers)
    assert predicted * B * T == pytest.approx(actual, rel=0.05)


def test_sinks_write_the_scores_out_only_off_flexattention():
    """gpt-oss 20b at T 4096 on a GPU: SDPA's path keeps each head's fp32 (T, T + 1) scores,
    FlexAttention's only its log-sum-exp."""
    T = 4096
    per_token = {}
    for backend in ("sdpa", "flex"):
        args = model_args("gpt_oss", "20b", attention=backend)
        job = Job(shape=model_shape(args, T), seq_len=T, global_batch_size=8, gpu=True, bf16=True)
        per_token[backend] = block_activations(job, Layout(micro_batch_size=1), job.shape.blocks[1], 1)[0]
    scores = args.n_heads * (T + 1) * 4
    assert per_token["sdpa"] - per_token["flex"] > scores
    assert per_token["flex"] < 0.25 * per_token["sdpa"]


def test_fla_keeps_less_than_the_chunked_reference():
    """A Qwen3.5 9b Gated DeltaNet block on a GPU: fla's kernel keeps its inputs and one (T, C)
    matrix; the PyTorch reference its per-chunk C x C matrices and the states too."""
    T, args = 4096, model_args("qwen3_5", "9b")
    kept = {}
    for fla in (False, True):
        job = Job(shape=model_shape(args, T), seq_len=T, global_batch_size=8, gpu=True, bf16=True, fla=fla)
        assert job.shape.blocks[0].kind == "linear_attention" and job.shape.blocks[0].mixer == (16, 32, 128, 128, 4, 64)
        kept[fla] = block_activations(job, Layout(micro_batch_size=1), job.shape.blocks[0], 0)[0]
    assert kept[True] < 0.7 * kept[False]
