"""QK-clip (Kimi K2, arXiv 2507.20534, section 2.1): attention logits held at a threshold tau
by rescaling query and key weights after the optimizer step. With Muon it makes MuonClip;
it works after any optimizer.

For a head h whose largest logit in the step, S_h = max q_h . k_h / sqrt(d), exceeded tau,
gamma_h = tau / S_h (else 1), and the head's weights are scaled so that every logit of the
head is multiplied by gamma_h, its max falling to tau:

- multi-head attention: W_q^h and W_k^h by sqrt(gamma_h) each (the paper);
- multi-head latent attention: the head-specific q^C, k^C rows by sqrt(gamma_h), the
  head-specific rotary q^R by gamma_h, the rotary key k^R, shared by every head, untouched
  (the paper);
- grouped-query attention (forja's choice, by the paper's rule for the shared k^R): a key head
  shared by several query heads is left alone and each query head takes the whole gamma_h,
  so no head below tau is touched.

This module knows rows and factors, not models: forja/train/step/attention_logits.py says which
rows of which weight belong to which head ("segments") and hands over the step's maxima.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

Segments = list[tuple[int, float]]  # per head, in row order: (rows, power of gamma), e.g. [(dn, 0.5), (dr, 1.0)]


def clip_factors(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma = min(1, tau / S) per head; 1 where S <= tau (or no logit was seen: -inf)."""
    over = max_logits > tau
    return torch.where(over, tau / max_logits.clamp(min=tau), torch.ones_like(max_logits))


def row_factors(gamma: torch.Tensor, segments: Segments) -> torch.Tensor:
    """(H,) gamma -> (H * sum(rows),) the factor of each row of a weight laid out head by head."""
    parts = [gamma[:, None].pow(power).expand(-1, rows) for rows, power in segments]  # (H, rows) each
    return torch.cat(parts, dim=1).reshape(-1)


@torch.no_grad()
def scale_rows(tensor: torch.Tensor, factors: torch.Tensor) -> None:
    """tensor[i, ...] *= factors[i] in place, for the rows this rank holds (a DTensor's block:
    FSDP's and TP's row shards alike)."""
    if isinstance(tensor, DTensor):
        chunk = tensor.__create_chunk_list__()[0]
        start, rows = chunk.offsets[0], chunk.sizes[0]
        local = tensor.to_local()
    else:
        start, rows, local = 0, tensor.shape[0], tensor
    f = factors[start:start + rows].to(local.device, local.dtype)
    local.mul_(f.view(-1, *([1] * (local.dim() - 1))))
