"""Ring attention: keys and values pass around the context-parallel ranks, and each rank
merges its queries' attention over every block of keys it is handed (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"), with the online softmax of flash attention
(Dao 2023): each block's output and log-sum-exp are combined without the whole row's scores.

Each rank holds two chunks of its rows (layout.py: chunk r and its mirror), so a hop hands
it another rank's two chunks of keys; of the four (query chunk, key chunk) blocks, those that
causal order, the sliding window or the documents hide are skipped, the others masked per
block (blocks.py computes one). The backward recomputes each block's probabilities from the
saved log-sum-exp and passes the keys and values around again, with the gradients of the
keys and values riding one hop behind until they reach their owner. Saved per layer: q, k,
v, the output and the log-sum-exp, O(T / cp); computed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forja.parallel.cp.blocks import block_backward, block_forward, block_probs, can_fuse, finite
from forja.parallel.cp.comm import RingExchange
from forja.parallel.cp.layout import SequenceLayout

KV_TAG, GRAD_TAG = 0, 1  # exchanges in flight together (keys and values, their gradients)
# A block's scores are written out a tile of query rows at a time, at most this many fp32
# values (256 MiB): a chunk of 8k tokens with 32 heads would be 8.6 GB at once.
TILE_SCORES = 1 << 26


@dataclass
class RingPlan:
    """One forward's ring: the layout, the rows' documents and the blocks' window."""

    layout: SequenceLayout
    exchange: RingExchange
    document_ids: torch.Tensor | None
    """(B, T) the whole rows' documents; None: one document per row."""
    window: int | None
    """Sliding window (a query sees keys less than this far back); None: all."""
    selection: torch.Tensor | None = None
    """(B, Tl, T) bool: of the keys the rest allows, those each of this rank's queries (in its
    order) attends to, by their place in the row (DeepSeek Sparse Attention's top-k); None: all."""

    def block_mask(self, a: int, b: int, device: torch.device) -> torch.Tensor | None | bool:
        """Which keys of chunk b the queries of chunk a see: False when none can (the block
        is skipped), None when all do, else a (B or 1, c, c) bool mask."""
        c = self.layout.chunk
        if b > a:
            return False
        nearest, farthest = (a - b) * c - (c - 1), (a - b) * c + (c - 1)  # q - k over the block
        if self.window is not None and nearest >= self.window:
            return False
        needs_window = self.window is not None and farthest >= self.window
        if a > b and not needs_window and self.document_ids is None and self.selection is None:
            return None
        q_pos = torch.arange(a * c, (a + 1) * c, device=device)[:, None]
        k_pos = torch.arange(b * c, (b + 1) * c, device=device)[None, :]
        allowed = q_pos >= k_pos  # (c, c)
        if needs_window:
            allowed = allowed & (q_pos - k_pos < self.window)
        allowed = allowed[None]  # (1, c, c)
        if self.document_ids is not None:
            docs = self.document_ids.to(device)
            allowed = allowed & (docs[:, a * c:(a + 1) * c, None] == docs[:, None, b * c:(b + 1) * c])
        if self.selection is not None:
            i = self.layout.my_chunks.index(a)  # the selection's rows are this rank's queries, in its order
            allowed = allowed & self.selection[:, i * c:(i + 1) * c, b * c:(b + 1) * c].to(device)
        if (self.document_ids is not None or self.selection is not None) and not bool(allowed.any()):
            return False
        return allowed

    def blocks(self, owner: int, device: torch.device, heads: int):
        """(local query rows, slice of the owner's keys, mask rows) of each tile of each block
        to compute, with `heads` (batch x query heads) x rows x chunk scores at most TILE_SCORES."""
        c = self.layout.chunk
        rows = max(1, min(c, TILE_SCORES // (heads * c)))
        for i, a in enumerate(self.layout.my_chunks):
            for j, b in enumerate(self.layout.chunks_of(owner)):
                mask = self.block_mask(a, b, device)
                if mask is False:
                    continue
                for start in range(0, c, rows):
                    stop = min(c, start + rows)
                    tile = None if mask is None else mask[:, start:stop]
                    yield slice(i * c + start, i * c + stop), slice(j * c, (j + 1) * c), tile


def _forward(q, k, v, plan: RingPlan, scale: float, fused: bool):
    """q (B, Hkv, g, Tl, d) fp32 -> out (B, Hkv, g, Tl, dv), lse (B, Hkv, g, Tl)."""
    B, Hkv, g, Tl, d = q.shape
    out = q.new_zeros(B, Hkv, g, Tl, v.shape[-1])
    lse = q.new_full((B, Hkv, g, Tl), float("-inf"))
    layout, kv = plan.layout, torch.cat([k, v], dim=-1)  # one message a hop
    for step in range(layout.cp):
        owner = (layout.rank - step) % layout.cp
        pending = plan.exchange.start((kv,), KV_TAG) if step + 1 < layout.cp else None
        k, v = kv.split([d, kv.shape[-1] - d], dim=-1)
        for qs, ks, mask in plan.blocks(owner, q.device, B * Hkv * g):
            block_out, block_lse = block_forward(q[..., qs, :], k[:, :, ks], v[:, :, ks], mask, scale, fused)
            merged = torch.logaddexp(lse[..., qs], block_lse)  # the online softmax's merge
            keep, add = torch.exp(lse[..., qs] - finite(merged)), torch.exp(block_lse - finite(merged))
            out[..., qs, :] = out[..., qs, :] * keep[..., None] + block_out * add[..., None]
            lse[..., qs] = merged
        if pending is not None:
            (kv,) = pending.wait()
    return out, lse


def _backward(q, k, v, out, lse, d_out, d_lse, plan: RingPlan, scale: float, fused: bool):
    """Gradients of q (B, Hkv, g, Tl, d), k and v (B, Hkv, Tl, .), all fp32."""
    # D = rowsum(dO * O) - dlse: the softmax's backward, with the log-sum-exp's own gradient
    D = (d_out * out).sum(-1)
    if d_lse is not None:
        D = D - d_lse
    lse = finite(lse)
    d = q.shape[-1]
    dq = torch.zeros_like(q)
    layout, incoming, kv = plan.layout, None, torch.cat([k, v], dim=-1)
    for step in range(layout.cp):
        owner = (layout.rank - step) % layout.cp
        pending = plan.exchange.start((kv,), KV_TAG) if step + 1 < layout.cp else None
        k, v = kv.split([d, kv.shape[-1] - d], dim=-1)
        dkv = torch.zeros_like(kv)  # this rank's share of the owner's key and value gradients
        dk, dv = dkv.split([d, kv.shape[-1] - d], dim=-1)
        for qs, ks, mask in plan.blocks(owner, q.device, q.shape[:3].numel()):
            grads = block_backward(q[..., qs, :], k[:, :, ks], v[:, :, ks], out[..., qs, :], lse[..., qs],
                                   d_out[..., qs, :], D[..., qs], mask, scale, fused)
            dq[..., qs, :] += grads[0]
            dk[:, :, ks] += grads[1]
            dv[:, :, ks] += grads[2]
        # The owner's gradients so far come from the previous rank, which had its keys a hop ago.
        if incoming is not None:
            dkv = dkv + incoming.wait()[0]
        incoming = plan.exchange.start((dkv,), GRAD_TAG)
        if pending is not None:
            (kv,) = pending.wait()
    (dkv,) = incoming.wait()  # the previous rank's last share is for this rank's own keys: complete
    return dq, *dkv.split([d, dkv.shape[-1] - d], dim=-1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, scale: float, sinks: bool):
        dtype = q.dtype
        B, H, Tl, d = q.shape
        Hkv = k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qg = q.float().view(B, Hkv, H // Hkv, Tl, d)  # (B, Hkv, g, Tl, d): query heads by their key head
            ctx.fused = can_fuse(qg, v, sinks)
            out, lse = _forward(qg, k.float(), v.float(), plan, scale, ctx.fused)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.view(B, H, Tl, -1).to(dtype), lse.view(B, H, Tl)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, Tl, d = q.shape
        Hkv = k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            grouped = (B, Hkv, H // Hkv, Tl)
            dq, dk, dv = _backward(q.float().view(*grouped, d), k.float(), v.float(), out, lse,
                                   d_out.float().view(*grouped, -1),
                                   None if d_lse is None else d_lse.float().view(grouped), ctx.plan, ctx.scale,
                                   ctx.fused)
        return dq.view(B, H, Tl, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                   scale: float, sinks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Tl, d), k (B, Hkv, Tl, d), v (B, Hkv, Tl, dv), this rank's tokens in its layout
    -> (out (B, H, Tl, dv) in q's dtype, lse (B, H, Tl) fp32, natural log). `sinks`: the
    caller differentiates through lse (the blocks are then written out)."""
    return _RingAttention.apply(q, k, v, plan, scale, sinks)


@torch.no_grad()
def ring_probs(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, plan: RingPlan, scale: float) -> torch.Tensor:
    """The attention's probabilities summed over heads, without gradients (DeepSeek Sparse
    Attention's indexer target): q (B, H, Tl, d) and k (B, Hkv, Tl, d) this rank's, lse (B, H, Tl)
    `ring_attention`'s under the same plan -> (B, Tl, T) fp32, the keys in row order. The keys
    go round the ring once more; each block's probabilities come from the merged lse."""
    B, H, Tl, d = q.shape
    Hkv = k.shape[1]
    layout, c = plan.layout, plan.layout.chunk
    qg = q.float().view(B, Hkv, H // Hkv, Tl, d)
    lse = finite(lse.float().view(B, Hkv, H // Hkv, Tl))
    total = q.new_zeros(B, Tl, layout.seq_len, dtype=torch.float32)
    keys = k.float()
    for step in range(layout.cp):
        owner = (layout.rank - step) % layout.cp
        pending = plan.exchange.start((keys,), KV_TAG) if step + 1 < layout.cp else None
        for qs, ks, mask in plan.blocks(owner, q.device, B * H):
            b = layout.chunks_of(owner)[ks.start // c]  # the key chunk's place in the row
            total[:, qs, b * c:(b + 1) * c] = block_probs(qg[..., qs, :], keys[:, :, ks], lse[..., qs], mask, scale)
        if pending is not None:
            (keys,) = pending.wait()
    return total
