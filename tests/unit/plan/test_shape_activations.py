"""The planner's counts against the models themselves: parameters by how TP and EP split
them, and the bytes a block saves for backward against what autograd really saves."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_model
from forja.models.common.attention import build_mask
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations
from forja.plan.shape import model_shape

CASES = [("llama", "debug", "0"), ("llama", "tiny", "0"), ("qwen3", "debug", "0"), ("qwen3", "debug-moe", "1"),
         ("gpt2", "debug", "0")]


@pytest.mark.parametrize("family,flavor,_", CASES)
def test_parameter_counts_add_up_to_the_model(family, flavor, _):
    model = build_model(family, flavor)
    shape = model_shape(model.args, 128)
    assert shape.n_params == model.num_params()
    for block, shape_block in zip(model.layers.values(), shape.blocks):
        experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
        assert shape_block.experts == experts
        norms = sum(p.numel() for n, p in block.named_parameters() if "norm" in n)
        assert shape_block.replicated >= norms  # norms are never split by TP


def saved_bytes(block: torch.nn.Module, h: torch.Tensor, rope, mask) -> int:
    """Bytes of the distinct storages autograd saves in one block's forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(h, rope, mask)
    return sum(seen.values())


@pytest.mark.parametrize("family,flavor,layer", CASES)
def test_block_activations_match_what_autograd_saves(family, flavor, layer):
    torch.manual_seed(0)
    model = build_model(family, flavor)
    B, T = 2, 64
    tokens = torch.randint(0, model.args.vocab_size, (B, T))
    positions = torch.arange(T)
    h = model.add_positions(model.tok_embeddings(tokens), positions).detach().requires_grad_()
    rope = model.rope_tables(positions)
    actual = saved_bytes(model.layers[layer], h, rope, build_mask(None, q_len=T, kv_len=T))
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False, bf16=False)
    block = job.shape.blocks[int(layer)]
    predicted, _ = block_activations(job, Layout(micro_batch_size=B), block, int(layer))
    # Per token; the rotary tables (per position, shared by the batch) are left out of the model.
    assert predicted * B * T == pytest.approx(actual, rel=0.05)
