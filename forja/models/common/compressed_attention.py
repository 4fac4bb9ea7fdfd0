"""DeepSeek-V4's attention (2026, sections 2.3.1-2.3.3): shared-key-value multi-query attention
over a sliding window, plus compressed entries of the whole past.

    q   = rms_head(wq_b(norm(wq_a x)))           (B, H, T, hd)  low-rank queries, unit RMS per head
    kv  = norm(wkv x)                            (B, 1, T, hd)  one head, read as key AND value
    RoPE (interleaved) on the last R channels of q and kv
    keys = [the latest `window` positions | compressed entries]   (kv_compressor.py)
    o   = softmax([q k^T / sqrt(hd) + mask, sink_h]) v, the sink's share dropped
    RoPE at -position on o's last R channels     (values carried RoPE: undo it at the query)
    y   = grouped low-rank projection of o       (grouped_output.py)

Three kinds of block: "sliding_attention" (the window only), "heavily_compressed_attention"
(HCA: the window and every complete window of `ratio` tokens compressed to one entry) and
"compressed_sparse_attention" (CSA: overlapping windows of `ratio`, of which each query
attends only the `topk` a lightning indexer picks).

Packed rows (the mask's `windows`, one layout a ratio): the window stays within each document and the
compressors pool each document's windows as if it were alone (`DocumentWindows`), so a packed
row computes what its documents would one row each.
"""

from __future__ import annotations

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache, unit_rms
from forja.models.common.grouped_output import GroupedLowRankOutput
from forja.models.common.kv_compressor import (
    CompressedIndexer,
    CompressorState,
    DocumentWindows,
    KVCompressor,
    chosen_entries_bias,
    entries_visible,
    rotate_tail,
)
from forja.models.common.norms import RMSNorm
from forja.models.common.precision import at_least_fp32

V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention block of `kind` (V4_LAYER_TYPES). `inv_freq` (R/2,) the
    compress RoPE's frequencies (HCA/CSA entries and the indexer's queries); `ratio`,
    `index_*` used by compressed kinds only."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, *, kind: str, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, inv_freq: torch.Tensor, ratio: int = 0, index_n_heads: int = 0,
                 index_head_dim: int = 0, index_topk: int = 0, eps: float = 1e-6):
        super().__init__()
        if kind not in V4_LAYER_TYPES:
            raise ForjaError(f"model.layer_types holds {kind!r}; each must be one of {', '.join(V4_LAYER_TYPES)}")
        self.kind, self.n_heads, self.head_dim, self.eps = kind, n_heads, head_dim, eps
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank, eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.wo = GroupedLowRankOutput(n_heads * head_dim, dim, o_groups, o_lora_rank)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        # The one key/value head every query head reads (with the compressed entries): a module only
        # so that a tensor-parallel plan can hook it (each rank's heads give its gradient a share).
        self.shared_kv = nn.Identity()
        self.compressor = None
        self.indexer = None
        if kind != "sliding_attention":
            csa = kind == "compressed_sparse_attention"
            self.compressor = KVCompressor(dim, head_dim, ratio, inv_freq, overlap=csa, eps=eps)
            if csa:
                self.indexer = CompressedIndexer(dim, q_lora_rank, index_n_heads, index_head_dim, ratio,
                                                 index_topk, inv_freq, eps=eps)
                # Its top-k choice passes no gradient (as in transformers, which trains no indexer
                # loss): frozen, so no optimizer keeps state it never steps (and a resume finds none).
                self.indexer.requires_grad_(False)

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"mixer": "compressed_attention", "sinks": True}

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x (B, T, dim); rope: this kind's cos, sin (T, R/2) at the queries' positions
        (`half_rope_tables`); mask: causal within the window over the cached and new positions,
        with `positions` (T,) set -> (B, T, dim). Under context parallelism (`mask.sequence`)
        x is this rank's part of the rows, and the window's keys and the compressed entries
        come from the whole rows (forja/parallel/cp/compressed.py)."""
        B, T, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))  # (B, T, r)
        q = self.wq_b(q_latent).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd); TP: this rank's H
        q = rotate_tail(unit_rms(q, self.eps), *rope)
        kv = rotate_tail(self.kv_norm(self.wkv(x)).unsqueeze(1), *rope)  # (B, 1, T, hd)
        if mask.sequence is not None:  # the rows are split over ranks (context parallelism)
            out = mask.sequence.compressed_attention(self, x, q_latent, q, kv, rope, mask.positions)
        else:
            if cache is not None:
                kv = cache.update(layer, kv, kv[..., :1])[0]  # values unused: K = V
            allowed = mask.dense[:, 0].to(x.device)  # (B or 1, T, Tk): the window, within documents
            bias = torch.zeros(allowed.shape, device=x.device).masked_fill(~allowed, float("-inf"))
            bias = bias.expand(B, -1, -1)
            if self.compressor is not None:
                windows = None if mask.windows is None else mask.windows[self.compressor.ratio]
                entries, extra = self._compressed(x, q_latent, rope, mask.positions, cache, layer,
                                                  windows)  # (B, N, hd), (B, T, N)
                kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)  # (B, 1, Tk + N, hd)
                bias = torch.cat([bias, extra], dim=-1)
            out = self.attend(q, kv, bias)
        out = rotate_tail(out.to(x.dtype), rope[0], -rope[1])  # undo the values' rotation at the query's position
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, hd) over the one key/value head kv (B, 1, K, hd) (window keys, then
        compressed entries), bias (B, T, K) additive (0 or -inf), with each head's sink
        -> (B, H, T, hd) in kv's dtype, the values' rotation still on."""
        B, _, T, _ = q.shape
        kv = self.shared_kv(kv)
        scores = (at_least_fp32(q) @ at_least_fp32(kv).transpose(-1, -2)) * self.head_dim**-0.5 + bias.unsqueeze(1)
        sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(B, -1, T, 1)  # scores (B, H, T, K)
        logits = torch.cat([scores, sink], dim=-1)
        probs = (logits - logits.amax(-1, keepdim=True)).softmax(dim=-1)[..., :-1]  # the sink's share dropped
        return probs.to(kv.dtype) @ kv  # (B, H, T, hd)

    def entry_bias(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   positions: torch.Tensor, n_entries: int, index_keys: torch.Tensor | None,
                   windows: DocumentWindows | None = None) -> torch.Tensor:
        """Which of `n_entries` compressed entries the queries x (B, T, dim) at `positions` (T,)
        see, as an additive bias (B, T, N): in CSA the indexer's picks over `index_keys`
        (B, N, index_head_dim), in HCA every complete window (of the query's own document,
        with `windows`)."""
        if windows is not None:
            visible = windows.visible(n_entries)  # (B, T, N)
        else:
            visible = entries_visible(positions, n_entries, self.compressor.ratio)[None]  # (1, T, N)
        if self.indexer is not None:
            with torch.no_grad():  # frozen, and its top-k passes no gradient: autograd (and AC) keep nothing
                picks = self.indexer.pick(x, q_latent, positions, rope, index_keys, visible)  # (B, T, k)
            return chosen_entries_bias(picks, n_entries, torch.float32)
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=x.device).masked_fill(~visible, float("-inf"))
        return bias.expand(x.shape[0], -1, -1)

    def _compressed(self, x, q_latent, rope, positions, cache, layer, windows: DocumentWindows | None = None):
        """(every compressed entry so far (B, N, hd), the queries' additive bias on them (B, T, N));
        `windows`: packed documents, each compressed alone (no cache then)."""
        state = None
        if cache is not None:
            state = cache.mixer_states.setdefault(layer, CompressorState())
        entries = self.compressor(x, state, windows)
        index_keys = None
        if self.indexer is not None:
            index_state = None if state is None else state.extra.setdefault("indexer", CompressorState())
            with torch.no_grad():  # its keys only rank entries
                index_keys = self.indexer.compressor(x, index_state, windows)  # (B, N, index_head_dim)
        return entries, self.entry_bias(x, q_latent, rope, positions, entries.shape[1], index_keys, windows)
