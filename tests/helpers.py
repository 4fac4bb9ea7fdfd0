"""Small helpers shared by tests."""

from __future__ import annotations

import torch


@torch.no_grad()
def max_logit_diff(hf_model, forja_model, tokens: torch.Tensor) -> float:
    """max |logits of transformers - logits of forja| over a batch, in float32."""
    ref = hf_model(tokens).logits.float()
    ours = forja_model(tokens).float()
    return (ref - ours).abs().max().item()
