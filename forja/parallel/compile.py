"""`torch.compile` per transformer block, and the loss on the logits.

Compiling each block rather than the whole model keeps compile time proportional to one
block (all blocks share the compiled code) and composes with FSDP's per-block hooks.
`nn.Module.compile()` compiles in place, so parameter names (and checkpoints) do not change.

The loss is compiled apart, on the logits (torchtitan's "loss" component does the same):
its log-softmax, gather and their backward become one pass over the (tokens, vocab) logits
instead of several, +1-2% a step at the default recipe's 8,192-token vocabulary on a CPU
(bench/RESULTS.md). The output projection stays outside it, a parameter FSDP manages.
"""

from __future__ import annotations

import torch
from torch import nn

from forja.eager import before_compile


def apply_compile(model: nn.Module, backend: str = "inductor", *, loss: bool = True) -> None:
    """Compile each block, and the loss on the logits where `loss` and the model makes
    logits (a last pipeline stage or a whole model, not fused into the output projection)."""
    before_compile()  # the functions marked eager_only, disabled before any block is traced
    for block in model.layers.values():
        block.compile(fullgraph=False, backend=backend)
    if loss and getattr(model, "output", None) is not None and "cross_entropy" not in model.args.fused_ops:
        model.token_loss = torch.compile(model.token_loss, backend=backend)
