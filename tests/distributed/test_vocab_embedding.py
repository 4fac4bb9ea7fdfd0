"""The vocabulary-split embedding (forja/parallel/vocab_embedding.py) on 2 Gloo ranks: the
same output and gradient as one process's nn.Embedding, with and without sequence
parallelism, over a vocabulary torch.chunk splits unevenly; and no (vocab, dim) tensor is
ever made in its backward (DTensor's own embedding backward makes one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from forja.parallel.vocab_embedding import vocab_parallel_styles
from forja.testing import run_distributed

VOCAB, DIM = 11, 6  # 11 rows over 2 ranks: 6 and 5


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns on this rank (a DTensor's local one)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.to_local().shape if isinstance(t, DTensor) else t.shape))
        return out


def _run(rank: int, world: int, sequence_parallel: bool, forja_style: bool):
    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, DIM)
    tokens = torch.randint(0, VOCAB, (2, 8))
    out_grad = torch.randn(2, 8, DIM)
    reference(tokens).backward(out_grad)

    mesh = init_device_mesh("cpu", (world,))
    emb = nn.Embedding(VOCAB, DIM)
    emb.load_state_dict(reference.state_dict())
    layout = Shard(1) if sequence_parallel else Replicate()
    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=layout)}
    holder = nn.ModuleDict({"emb": emb})
    parallelize_module(holder, mesh, vocab_parallel_styles(plan, holder) if forja_style else plan)
    out = emb(tokens)
    local_grad = out_grad.chunk(world, dim=1)[rank] if sequence_parallel else out_grad
    expected = reference(tokens).detach()
    expected = expected.chunk(world, dim=1)[rank] if sequence_parallel else expected
    shapes = _Shapes()
    with shapes:
        out.backward(local_grad)
    got = emb.weight.grad
    return (float((out.detach() - expected).abs().max()),
            float((got.full_tensor() - reference.weight.grad).abs().max()),
            str(got.placements), (VOCAB, DIM) in shapes.shapes)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_matches_one_process_and_keeps_gradient_local(sequence_parallel):
    for out_err, grad_err, placements, made_whole in run_distributed(_run, 2, sequence_parallel, True):
        assert out_err == 0.0 and grad_err < 1e-6
        assert placements == "(Shard(dim=0),)"
        assert not made_whole


def test_torchs_rowwise_style_makes_the_whole_gradient():
    """What forja's style removes, shown on torch's: the check above can fail."""
    results = run_distributed(_run, 2, True, False)
    assert all(made_whole for *_, made_whole in results)
