"""Activation checkpointing's op-level policy, eager and compiled."""

from __future__ import annotations

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
