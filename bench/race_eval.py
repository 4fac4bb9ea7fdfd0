"""The loss race's one evaluator (bench/loss_race.py): every contender's model, forja's or a
peer's, in this process or in its own environment, is scored by `held_out_loss` on the same
held-out windows. Needs only torch, so every environment can import it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Windows = list[tuple[torch.Tensor, torch.Tensor]]


def save_windows(windows: Windows, path: str) -> None:
    torch.save({"inputs": torch.stack([i for i, _ in windows]), "labels": torch.stack([lab for _, lab in windows])},
               path)


def load_windows(path: str) -> Windows:
    """The (inputs, labels) pairs `save_windows` wrote, each (B, T) int64; tensors only, never pickled objects."""
    saved = torch.load(path, weights_only=True)
    return list(zip(saved["inputs"].unbind(0), saved["labels"].unbind(0)))


@torch.no_grad()
def held_out_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], windows: Windows) -> float:
    """Mean next-token cross-entropy over the windows' labelled tokens (labels >= 0), from the
    logits (B, T, V) that `logits_of(inputs)` returns, in fp32."""
    total, count = 0.0, 0
    for inputs, labels in windows:
        logits = logits_of(inputs)  # (B, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                 reduction="sum").item()
        count += int((labels >= 0).sum())
    return total / count
