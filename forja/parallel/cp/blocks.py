"""One block of ring attention: a tile of queries against one chunk of keys, its output and
log-sum-exp (forward), and its share of the gradients given the whole row's output and
log-sum-exp (backward, as flash attention's backward takes them); and, given that log-sum-exp,
its probabilities summed over heads (`block_probs`, written out: DeepSeek Sparse Attention's
indexer target).

Two implementations, the same numbers to fp32 rounding (tests/distributed/test_cp_mixing.py):
- fused: PyTorch's CPU flash-attention kernels, the ones SDPA runs on CPU, called directly
  (`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu` and its backward, which
  return and take the log-sum-exp SDPA keeps to itself); taken on CPU when keys and values
  are as wide and no sink needs the log-sum-exp's gradient;
- written out: the scores as fp32 matmuls, elsewhere (CUDA, sinks, latent attention's
  narrower values).
Shapes: q (B, Hkv, g, r, d), query heads grouped by their key head; k (B, Hkv, ck, d);
v (B, Hkv, ck, dv); mask (B or 1, r, ck) bool or None (all visible).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def fused_kernels() -> tuple | None:
    """(forward, backward) of the CPU flash kernels when this PyTorch has them."""
    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return (forward, backward) if forward is not None and backward is not None else None


def can_fuse(q: torch.Tensor, v: torch.Tensor, sinks: bool) -> bool:
    return q.device.type == "cpu" and v.shape[-1] == q.shape[-1] and not sinks and fused_kernels() is not None


def finite(x: torch.Tensor) -> torch.Tensor:
    """x with -inf (a query that sees nothing yet) as 0, so exp(s - x) stays 0, not NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def block_forward(q, k, v, mask, scale: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, Hkv, g, r, dv), lse (B, Hkv, g, r): -inf where a query sees none of the keys."""
    B, Hkv, g, r, d = q.shape
    if fused:
        forward, _ = fused_kernels()
        qh, kh, vh = _by_head(q, k, v)
        out, lse = forward(qh, kh, vh, 0.0, False, attn_mask=_additive(mask), scale=scale)
        lse = lse.view(B, Hkv, g, r)
        if mask is not None:  # the kernel gives 0 for a row that sees nothing
            lse = lse.masked_fill(~mask.any(-1)[:, None, None], NEG_INF)
        return out.view(B, Hkv, g, r, -1), lse
    s = _scores(q, k, mask, scale)  # (B, Hkv, g, r, ck)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - finite(lse)[..., None])
    return (p.flatten(2, 3) @ v).view(B, Hkv, g, r, -1), lse


def block_backward(q, k, v, out, lse, d_out, D, mask, scale: float, fused: bool):
    """The block's shares of dq (as q), dk, dv (as k, v), from the whole row's `out` and
    finite `lse`; D = rowsum(dO * O) - dlse (B, Hkv, g, r), which the fused kernel computes
    itself (its callers have no dlse)."""
    B, Hkv, g, r, d = q.shape
    if fused:
        _, backward = fused_kernels()
        qh, kh, vh = _by_head(q, k, v)
        dq, dk, dv = backward(d_out.reshape(B, Hkv * g, r, -1), qh, kh, vh, out.reshape(B, Hkv * g, r, -1),
                              lse.reshape(B, Hkv * g, r), 0.0, False, attn_mask=_additive(mask), scale=scale)
        ck = k.shape[2]
        return dq.view(q.shape), dk.view(B, Hkv, g, ck, -1).sum(2), dv.view(B, Hkv, g, ck, -1).sum(2)
    p = torch.exp(_scores(q, k, mask, scale) - lse[..., None])  # (B, Hkv, g, r, ck)
    dv = torch.einsum("bhgqk,bhgqv->bhkv", p, d_out)
    ds = p * (torch.einsum("bhgqv,bhkv->bhgqk", d_out, v) - D[..., None])
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q) * scale
    return dq, dk, dv


def block_probs(q, k, lse, mask, scale: float) -> torch.Tensor:
    """The block's attention probabilities summed over the query heads (B, r, ck), from the
    whole row's finite `lse` (B, Hkv, g, r); 0 at hidden keys."""
    return torch.exp(_scores(q, k, mask, scale) - lse[..., None]).sum((1, 2))


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """-> scores (B, Hkv, g, r, ck), hidden ones -inf."""
    B, Hkv, g, r, d = q.shape
    s = (q.reshape(B, Hkv, g * r, d) @ k.transpose(-1, -2)).view(B, Hkv, g, r, -1) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], NEG_INF)
    return s


def _by_head(q, k, v):
    """q (B, H, r, d) and k, v repeated to one per query head, as the kernels take them."""
    B, Hkv, g, r, d = q.shape
    return q.reshape(B, Hkv * g, r, d), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A bool mask (B|1, r, ck) as the kernels take it: (B|1, 1, r, ck) fp32, -inf where hidden."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, NEG_INF)[:, None]
