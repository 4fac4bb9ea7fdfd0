"""The largest attention logit of each head, kept by attention modules for QK-clip.

SDPA and FlexAttention never return their scores, so when asked (the step context's
`track_max_logit`, forja/models/common/step_context.py, which the step engine sets for
optim.qk_clip_tau or optim.max_logit_metric) an attention
module recomputes max(q . k) * scale per head under no_grad, a chunk of queries at a time,
honouring its mask (causal, documents, sliding window; a FlexAttention block mask through its
mask_mod). This costs one more q k^T product per layer, only while it is on. `mask` is an
attention.AttentionMask (read by its fields: is_causal, dense, block_mask).
"""

from __future__ import annotations

import torch

from forja.eager import eager_only
from forja.models.common.step_context import OUTSIDE_A_STEP, StepContext

MAX_LOGIT_CHUNK = 2**24  # scores (elements) one chunk of max_logits holds at a time


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """The largest attention logit q.k * scale of each query head where the mask allows it: q
    (B, H, Tq, d), k (B, Hkv, Tk, d) -> (H,) float32. SDPA and FlexAttention never return
    scores, so they are recomputed here, a chunk of queries at a time."""
    B, H, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv, Tq, d)  # (B, Hkv, G, Tq, d): a group's heads share one key head
    kt = k[:, :, None].transpose(-1, -2)  # (B, Hkv, 1, d, Tk)
    chunk = max(1, MAX_LOGIT_CHUNK // max(B * H * Tk, 1))
    best = torch.full((Hkv, H // Hkv), -torch.inf, device=q.device)
    for start in range(0, Tq, chunk):
        end = min(start + chunk, Tq)
        scores = (qg[..., start:end, :] @ kt).float() * scale  # (B, Hkv, G, C, Tk)
        allowed = _allowed(mask, B, start, end, Tq, Tk, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -torch.inf)
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))
    return best.reshape(H)


def _allowed(mask, B: int, start: int, end: int, Tq: int, Tk: int,
             device: torch.device) -> torch.Tensor | None:
    """Queries start..end of `mask` as a (B | 1, 1, 1, C, Tk) boolean, or None: all allowed."""
    q_pos = torch.arange(start, end, device=device)[:, None] + (Tk - Tq)  # (C, 1)
    k_pos = torch.arange(Tk, device=device)[None, :]  # (1, Tk)
    if mask.block_mask is not None:  # evaluate its mask_mod on the chunk's positions
        b = torch.arange(B, device=device)[:, None, None]
        allowed = mask.block_mask.mask_mod(b, torch.zeros_like(b), q_pos[None], k_pos[None])  # (B, C, Tk)
        return allowed[:, None, None]
    if mask.dense is not None:
        return mask.dense.to(device)[:, :, start:end][:, :, None]
    if mask.is_causal:
        return (q_pos >= k_pos)[None, None, None]
    return None


class MaxLogitTracking:
    """Keeps the per-head max attention logit of the training forwards since the last
    `take_max_logit` when its step context says so (QK-clip and the attn/max_logit metric: the
    step engine hands the context). Heads are this module's: under tensor parallelism, this rank's."""

    step_context: StepContext = OUTSIDE_A_STEP
    max_logit: torch.Tensor | None = None  # (H,) float32

    @property
    def track_max_logit(self) -> bool:
        return self.step_context.track_max_logit

    def track_logits(self, q: torch.Tensor, k: torch.Tensor, mask, scale: float) -> None:
        # Off, this is a branch a compiled block folds away; on, the recording runs eagerly.
        if self.track_max_logit and self.training:  # validation does not count
            self._record_max_logit(q, k, mask, scale)

    @eager_only  # state kept across forwards: eager, outside compiled graphs
    def _record_max_logit(self, q: torch.Tensor, k: torch.Tensor, mask, scale: float) -> None:
        new = max_logits(q.detach(), k.detach(), mask, scale)
        self.max_logit = new if self.max_logit is None else torch.maximum(self.max_logit, new)

    def take_max_logit(self) -> torch.Tensor | None:
        out, self.max_logit = self.max_logit, None
        return out
