"""Sequence parallelism's gathered input kept split until backward (forja/parallel/regather.py),
on 2 Gloo ranks: the same output and gradients as without it, and the gathered (B, T, D)
tensor freed once the forward is done (held until backward without it); compiled by inductor,
under the regather policy, the compiled graph saves it no more."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from forja.parallel.ac import CheckpointedBlock
from forja.parallel.regather import gathers_sequence, regather_in_backward, regather_policy
from forja.testing import run_distributed


class _FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(8, 24, bias=False), nn.Linear(8, 24, bias=False)
        self.w2 = nn.Linear(24, 8, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.feed_forward = nn.RMSNorm(8), _FeedForward()

    def forward(self, x):
        return x + self.feed_forward(self.norm(x))


GATHER = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def _sequence_parallel_block(world: int) -> tuple[_Block, object]:
    """The block under TP + SP over `world` ranks: its norm on the rank's slice of the
    sequence, its feed-forward's input gathered whole first."""
    torch.manual_seed(0)
    block = _Block()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(block, mesh, {"norm": SequenceParallel(), "feed_forward": GATHER,
                                     "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                                     "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    return block, mesh


def _run(rank: int, world: int, regather: bool):
    block, mesh = _sequence_parallel_block(world)
    if regather:
        regather_in_backward(block.feed_forward, mesh)
    seen = []
    block.feed_forward.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0]._local_tensor)))
    x = torch.randn(2, 8, 8).chunk(world, dim=1)[rank].requires_grad_()  # (B, T/tp, D)
    out = block(x)
    gathered_alive = seen[0]() is not None
    out.backward(torch.ones_like(out))
    grads = {n: p.grad.full_tensor() for n, p in block.named_parameters()}
    return out.detach(), x.grad, grads, gathered_alive


def test_same_values_and_the_gathered_input_freed_after_forward():
    plain, kept = run_distributed(_run, 2, False), run_distributed(_run, 2, True)
    for (out0, dx0, g0, alive0), (out1, dx1, g1, alive1) in zip(plain, kept):
        assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
        assert all(torch.equal(g0[n], g1[n]) for n in g0)
        assert alive0 and not alive1  # torch's style holds it until backward; regathered, it is gone


def _saved_by_compiled_graph(out: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the tensors inductor's compiled function keeps for its backward."""
    fn = out.grad_fn
    while type(fn).__name__ != "CompiledFunctionBackward":
        fn = next(f for f, _ in fn.next_functions if f is not None)
    return [tuple(t.shape) for t in fn.saved_tensors]


def _run_compiled(rank: int, world: int, regather: bool):
    block, mesh = _sequence_parallel_block(world)
    compiled = torch.compile(CheckpointedBlock(block, context_fn=regather_policy) if regather else block)
    x = torch.randn(2, 16, 8).chunk(world, dim=1)[rank].requires_grad_()  # (B, T/tp, D)
    out = compiled(x)
    saved = _saved_by_compiled_graph(out)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad, {n: p.grad.full_tensor() for n, p in block.named_parameters()}, saved


@pytest.mark.serial
def test_compiled_blocks_regather_under_the_policy():
    plain, kept = run_distributed(_run_compiled, 2, False, timeout_s=300), \
        run_distributed(_run_compiled, 2, True, timeout_s=300)
    for (out0, dx0, g0, saved0), (out1, dx1, g1, saved1) in zip(plain, kept):
        assert torch.allclose(out0, out1, atol=1e-6) and torch.allclose(dx0, dx1, atol=1e-6)
        assert all(torch.allclose(g0[n], g1[n], atol=1e-6) for n in g0)
        gathered = (2 * 16, 8)  # (B x T, D): the whole sequence's normalized input (w1's output: (32, 12))
        assert gathered in saved0 and gathered not in saved1, (saved0, saved1)


@pytest.mark.parametrize("style, gathers", [
    (GATHER, True),
    (PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)), False),
    (ColwiseParallel(), False),
])
def test_which_styles_gather_the_sequence(style, gathers):
    assert gathers_sequence(style) is gathers
