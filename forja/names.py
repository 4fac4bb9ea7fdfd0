"""Parameter names as the whole model spells them, whatever wraps its modules.

Activation checkpointing, torch.compile and FSDP insert wrapper modules into the names
(`layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight`); initialization,
optimizer rules and checkpoints need the plain name (`layers.0.attention.wq.weight`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

# Wrappers that activation checkpointing, torch.compile and FSDP1 insert into module names.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper modules removed: 'layers.0.attention.wq.weight'."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def named_unique_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Parameters once each (tied weights under their first name), names canonical."""
    for name, param in model.named_parameters():
        yield canonical_name(name), param
