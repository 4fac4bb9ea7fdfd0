"""Activation checkpointing's op-level policy, eager and compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forja.parallel.ac import CheckpointedBlock


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).sin()


def test_op_level_checkpointing_compiles_and_matches_the_block():
    """torch.compile traces a checkpoint from its policy's two dispatch modes and nothing else:
    the eager replay's extra context (FSDP's forward root) must stay out of a compiled graph."""
    torch.manual_seed(0)
    block = CheckpointedBlock(_Block(), op_level=True)
    x = torch.randn(4, 16, requires_grad=True)
    torch.compile(block, backend="aot_eager")(x).sum().backward()
    compiled, x.grad = x.grad, None
    block(x).sum().backward()  # eager, the same policy
    eager, x.grad = x.grad, None
    block._checkpoint_wrapped_module(x).sum().backward()
    torch.testing.assert_close(compiled, x.grad)
    torch.testing.assert_close(eager, x.grad, rtol=0, atol=0)


class _FourMatmuls(nn.Module):
    """Four bias-free projections (four `mm` calls), each read by an elementwise op."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x).sin()).sin()).sin()).sin()


def _saved_mm_outputs(block: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """How many `mm` calls a backward reruns, and the input's gradient."""
    calls = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    loss = block(x).sum()
    with Count():
        loss.backward()
    grad, x.grad = x.grad, None
    return len(calls), grad


def test_alternate_matmuls_recompute_every_second_mm_and_match_the_block():
    """parallel.ac_matmuls = "alternate" (torchtitan's op-level policy): of four mm calls the
    2nd and 4th are recomputed in backward, so backward runs 2 more than its own 8 (dX and dW
    of each); "all" reruns none. Gradients are the block's own, bit for bit."""
    torch.manual_seed(0)
    inner, x = _FourMatmuls(), torch.randn(4, 16, requires_grad=True)
    plain, expected = _saved_mm_outputs(inner, x)
    kept_all, grad_all = _saved_mm_outputs(CheckpointedBlock(inner, op_level=True), x)
    alternate, grad_alt = _saved_mm_outputs(CheckpointedBlock(inner, op_level=True, alternate=True), x)
    assert (plain, kept_all, alternate) == (8, 8, 10)
    torch.testing.assert_close(grad_all, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad_alt, expected, rtol=0, atol=0)


@pytest.mark.parametrize("op", [torch.ops.aten._scaled_dot_product_flash_attention.default,
                                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                                torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                                torch.ops.higher_order.flex_attention],
                         ids=["flash", "efficient", "cudnn", "flex"])
def test_op_level_ac_keeps_every_cuda_attention_kernels_output(op):
    """The GPU's attention kernels cannot run here with gradients (FlexAttention has no CPU
    backward): the policy itself is asked. What it keeps is what the memory model prices as
    kept (forja/plan/activations.py: the output and log-sum-exp); a kernel it left out would be
    recomputed in backward, attention's forward run twice. Without gradients (an indexer's
    scores) nothing is kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    from forja.parallel.ac import _save_matmuls

    assert _save_matmuls(None, op) == CheckpointPolicy.MUST_SAVE
    with torch.no_grad():
        assert _save_matmuls(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_alternate_matmuls_compile():
    torch.manual_seed(0)
    block, x = CheckpointedBlock(_FourMatmuls(), op_level=True, alternate=True), torch.randn(4, 16, requires_grad=True)
    torch.compile(block, backend="aot_eager")(x).sum().backward()
    compiled, x.grad = x.grad, None
    block._checkpoint_wrapped_module(x).sum().backward()
    torch.testing.assert_close(compiled, x.grad)


def _family_flavors() -> list[tuple[str, str]]:
    from forja.models.registry import FAMILIES

    return [(f, fl) for f, spec in sorted(FAMILIES.items()) for fl in spec.flavors if fl.startswith("debug")]


@pytest.mark.parametrize(("family", "flavor"), _family_flavors())
def test_every_family_trains_under_op_level_checkpointing_as_without(family, flavor):
    """A step with every block checkpointed and its matmuls kept: the replay must run the ops
    the forward ran (torch refuses any other), so a block whose bookkeeping differs between the
    two (a mixture of experts' running statistics, first summed from nothing) fails here; the
    gradients equal the model's without checkpointing."""
    from forja.models import build_model
    from forja.parallel import ParallelConfig
    from forja.parallel.ac import apply_ac

    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    grads = []
    for ac in ("none", "selective"):
        model = build_model(family, flavor, seed=0).train()
        apply_ac(model, ParallelConfig(ac=ac))
        model(tokens, labels=tokens.roll(-1, 1)).backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)
