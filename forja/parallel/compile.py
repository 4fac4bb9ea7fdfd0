"""`torch.compile` per transformer block.

Compiling each block rather than the whole model keeps compile time proportional to one
block (all blocks share the compiled code) and composes with FSDP's per-block hooks.
`nn.Module.compile()` compiles in place, so parameter names (and checkpoints) do not change.
"""

from __future__ import annotations

from torch import nn

from forja.eager import before_compile


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    before_compile()  # the functions marked eager_only, disabled before any block is traced
    for block in model.layers.values():
        block.compile(fullgraph=False, backend=backend)
