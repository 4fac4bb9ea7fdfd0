"""Token-level KV compression and the lightning indexer over compressed keys (DeepSeek-V4, 2026,
sections 2.3.1 "Compressed Sparse Attention" and 2.3.2 "Heavily Compressed Attention").

Every `ratio` consecutive tokens become one compressed entry: each token projects a value
C_j and a gate Z_j (per channel), and the entry of a window is the softmax-over-the-window
of (Z + B) weighing C, RMS-normalized, with interleaved RoPE on its last channels at the
position of the window's first token:

    e_w = norm( sum_j softmax_j(Z_j + B_j) * C_j ),  j in window w

Heavily compressed attention (HCA, ratio m' = 128) uses disjoint windows. Compressed sparse
attention (CSA, ratio m = 4) uses overlapping ones: each token projects two series, Ca and
Cb (twice the width), and entry w mixes window w-1's Ca with window w's Cb over 2m slots
(`overlap`). CSA then keeps, per query, only the `topk` entries a lightning indexer scores
highest (`CompressedIndexer`: sum_h w_h relu(q_h . k_s), as DeepSeek-V3.2's indexer, but over
its own compressed keys).

A query at position t may see entry w only once the window is complete: w < (t + 1) // ratio.
For decoding, `CompressorState` carries the tokens of an unfinished window, the last Ca slice
and the entries so far from one forward to the next.

Packed rows (`DocumentWindows`): every document is compressed as if it were alone, its windows
counted from its first token. Each document's projections are laid out from a multiple of
`ratio` (zeros fill its last window's tail, a window no query of it sees complete), a
document's first CSA window has no window before it (empty slots), each entry rotates at the
packed position of its window's first token, and a query sees only its own document's
complete windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from forja.models.common.norms import RMSNorm


def half_rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., T, R/2) float32 of `positions` (..., T): one angle per interleaved pair."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device).float()
    return angles.cos(), angles.sin()


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (pairs of adjacent channels) on the last R = 2 cos.shape[-1] channels
    of x (..., T, D), the others untouched; cos, sin (T, R/2). Computed in fp32."""
    R = 2 * cos.shape[-1]
    c = cos.to(x.dtype).repeat_interleave(2, dim=-1)  # (T, R)
    s = sin.to(x.dtype).repeat_interleave(2, dim=-1)
    nope, rope = x[..., :-R], x[..., -R:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)  # (..., T, R)
    rotated = (rope.float() * c + turned.float() * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def entries_visible(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """(T, N) bool: query at positions[t] may see compressed entry w (its window is complete)."""
    ready = (positions + 1) // ratio  # (T,)
    return torch.arange(n_entries, device=positions.device)[None, :] < ready[:, None]


@dataclass
class DocumentWindows:
    """Where the tokens of packed rows go when every document starts a window of `ratio`:
    each document's tokens keep their order from a multiple of `ratio` on (its last window's
    tail left empty), so the compressor pools each document's windows as if it were alone."""

    ratio: int
    index: torch.Tensor  # (B, T) long: each token's slot in the laid-out rows
    doc_start: torch.Tensor  # (B, T) long: the slot of the token's document's first token
    window_starts_doc: torch.Tensor  # (B, n) bool: the window is its document's first
    entry_positions: torch.Tensor  # (B, n) long: the packed position of each window's first token

    @classmethod
    def of(cls, document_ids: torch.Tensor, ratio: int) -> DocumentWindows:
        """The layout of rows whose documents (B, T) are contiguous runs of equal ids."""
        B, T = document_ids.shape
        t = torch.arange(T, device=document_ids.device).expand(B, T)
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        run = starts.long().cumsum(1) - 1  # (B, T): the document's index within its row
        first = torch.where(starts, t, 0).cummax(1).values  # (B, T): its first token's position
        lengths = torch.zeros(B, T, dtype=torch.long, device=t.device).scatter_add_(1, run, torch.ones_like(run))
        padded = (lengths + ratio - 1) // ratio * ratio  # (B, T) per document, 0 past the row's last
        offsets = padded.cumsum(1) - padded  # (B, T): each document's first slot
        doc_start = offsets.gather(1, run)
        index = doc_start + t - first
        n = int(padded.sum(1).max()) // ratio
        window_starts_doc = torch.zeros(B, n + 1, dtype=torch.bool, device=t.device)
        window_starts_doc.scatter_(1, torch.where(lengths > 0, offsets // ratio, n), True)
        slot_position = torch.zeros(B, n * ratio, dtype=torch.long, device=t.device).scatter_(1, index, t)
        return cls(ratio, index, doc_start, window_starts_doc[:, :n], slot_position[:, ::ratio])

    @property
    def n_windows(self) -> int:
        return self.entry_positions.shape[1]

    def lay_out(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, w) -> (B, n ratio, w), each token in its slot, zeros elsewhere."""
        out = x.new_zeros(x.shape[0], self.n_windows * self.ratio, x.shape[-1])
        return out.scatter(1, self.index[..., None].expand(-1, -1, x.shape[-1]), x)

    def visible(self, n_entries: int) -> torch.Tensor:
        """(B, T, N) bool: the query may see entry w, a complete window of its own document."""
        w = torch.arange(n_entries, device=self.index.device)[None, None, :] * self.ratio  # first slot of each
        return (w >= self.doc_start[..., None]) & (w + self.ratio <= self.index[..., None] + 1)


@dataclass
class CompressorState:
    """What one compressor carries between forwards of a decode (per layer)."""

    pending_kv: torch.Tensor | None = None  # (B, <ratio, width): tokens of the unfinished window
    pending_gate: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None  # (B, ratio, hd): the last complete window's Ca (overlap only)
    prev_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # (B, N, hd) compressed entries so far
    extra: dict = field(default_factory=dict)  # the indexer's own state, by name


class KVCompressor(nn.Module):
    """Compresses every `ratio` tokens of x (B, T, dim) into one entry (B, hd); `overlap`:
    CSA's two-series windows (width 2 hd projections). `inv_freq` (R/2,) the entries' RoPE."""

    def __init__(self, dim: int, head_dim: int, ratio: int, inv_freq: torch.Tensor, *, overlap: bool,
                 eps: float = 1e-6):
        super().__init__()
        width = (2 if overlap else 1) * head_dim
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.inv_freq = inv_freq  # not a buffer: float32 whatever the model's dtype, derived from args
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width))
        self.norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> each token's values and gates (B, T, width): what `pool` mixes."""
        return self.wkv(x), self.wgate(x)

    def forward(self, x: torch.Tensor, state: CompressorState | None = None,
                windows: DocumentWindows | None = None) -> torch.Tensor:
        """x (B, T, dim) -> every entry so far (B, N, hd): those of x's complete windows, after
        the state's (which then holds x's unfinished window). Without a state, positions start
        at 0 and an unfinished last window is dropped. `windows`: packed rows' documents, each
        pooled alone (no state then): N = windows.n_windows, some never visible."""
        kv, gate = self.project(x)  # (B, T, width)
        if windows is not None:
            return self.pool(windows.lay_out(kv), windows.lay_out(gate), 0, windows=windows)[0]
        first, prev = 0, None
        if state is not None:
            first = 0 if state.entries is None else state.entries.shape[1] * self.ratio
            if state.pending_kv is not None:
                kv, gate = torch.cat([state.pending_kv, kv], 1), torch.cat([state.pending_gate, gate], 1)
            if state.prev_kv is not None:
                prev = (state.prev_kv, state.prev_gate)
        usable = kv.shape[1] // self.ratio * self.ratio
        if state is not None:
            state.pending_kv, state.pending_gate = kv[:, usable:], gate[:, usable:]
        entries, last = self.pool(kv[:, :usable], gate[:, :usable], first, prev)
        if state is None:
            return entries
        if last is not None:
            state.prev_kv, state.prev_gate = last[0].clone(), last[1].clone()
        state.entries = entries if state.entries is None else torch.cat([state.entries, entries], 1)
        return state.entries

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int,
             prev: tuple[torch.Tensor, torch.Tensor] | None = None,
             windows: DocumentWindows | None = None) -> tuple[torch.Tensor, tuple | None]:
        """kv, gate (B, n m, width): the projections of n whole windows, the first starting at
        position `first`; `prev`: the window before's Ca and gate (B, m, hd) each, its position
        bias added (overlap only; None: empty slots) -> (the n entries (B, n, hd), the last
        window's Ca and gate for the next window's overlap, or None). `windows`: laid out by
        document (`DocumentWindows.lay_out`), whose first windows get empty slots too."""
        B, n = kv.shape[0], kv.shape[1] // self.ratio
        if not n:
            return kv.new_zeros(B, 0, self.head_dim), None
        kv = kv.reshape(B, n, self.ratio, -1)  # (B, n, m, width)
        gate = gate.reshape(B, n, self.ratio, -1) + self.position_bias
        last = None
        if self.overlap:
            last = (kv[:, -1, :, :self.head_dim], gate[:, -1, :, :self.head_dim])
            kv, gate = self._overlapping(kv, gate, prev)  # (B, n, 2m, hd)
            if windows is not None:  # a document's first window has none before it
                gate = gate.masked_fill(self._ca_slots(windows.window_starts_doc), float("-inf"))
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        entries = self.norm((kv * weights).sum(dim=2))  # (B, n, hd)
        positions = torch.arange(n, device=kv.device) * self.ratio + first  # (n,), or per row (B, n)
        if windows is not None:
            positions = windows.entry_positions
        return rotate_tail(entries, *half_rope_tables(self.inv_freq, positions)), last

    def _ca_slots(self, starts: torch.Tensor) -> torch.Tensor:
        """(B, n, 2m, 1) bool: the Ca slots (the window before's) of the windows in starts (B, n)."""
        slots = torch.zeros(2 * self.ratio, dtype=torch.bool, device=starts.device)
        slots[:self.ratio] = True
        return (starts[:, :, None] & slots)[..., None]

    def _overlapping(self, kv: torch.Tensor, gate: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None):
        """(B, n, m, 2 hd) projections -> (B, n, 2m, hd): window w's slots are window w-1's Ca
        then its own Cb. Window 0's Ca slots are `prev`'s (the window before, from an earlier
        forward or another rank), else empty: value 0, gate -inf (softmax weight 0)."""
        B, n, m, _ = kv.shape
        hd = self.head_dim
        slots_kv = kv.new_zeros(B, n, 2 * m, hd)
        slots_gate = gate.new_full((B, n, 2 * m, hd), float("-inf"))
        slots_kv[:, :, m:], slots_gate[:, :, m:] = kv[..., hd:], gate[..., hd:]
        slots_kv[:, 1:, :m], slots_gate[:, 1:, :m] = kv[:, :-1, :, :hd], gate[:, :-1, :, :hd]
        if prev is not None:
            slots_kv[:, 0, :m] = prev[0].to(kv.dtype)
            slots_gate[:, 0, :m] = prev[1].to(gate.dtype)
        return slots_kv, slots_gate


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at `head_dim` makes the keys,
    queries come from the attention's query latent (B, T, q_lora_rank), and each query keeps
    the `topk` visible entries of highest sum_h w_h relu(q_h . k_s) / sqrt(hd) / sqrt(heads)."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int, topk: int,
                 inv_freq: torch.Tensor, *, eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.head_dim, self.ratio, self.topk = n_heads, head_dim, ratio, topk
        self.compressor = KVCompressor(dim, head_dim, ratio, inv_freq, overlap=True, eps=eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], state: CompressorState | None = None) -> torch.Tensor:
        """x (B, T, dim), q_latent (B, T, r), positions (T,), rope: the queries' cos, sin (T, R/2)
        -> the chosen entries (B, T, k), k = min(topk, entries), -1 where a pick is not visible."""
        return self.pick(x, q_latent, positions, rope, self.compressor(x, state))

    def pick(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
             visible: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` for queries x, q_latent at `positions` over compressed keys (B, N, hd) made
        already (under context parallelism: the whole rows' keys, for this rank's queries);
        `visible` (B, T, N): which entries each query may pick, if not the complete windows
        before it (packed documents: `DocumentWindows.visible`)."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        q = rotate_tail(q, *rope).transpose(1, 2)  # (B, T, h, hd)
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5  # (B,T,h,N)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # (B, T, h)
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # (B, T, N)
        N = keys.shape[1]
        k = min(self.topk, N)
        if N == 0:
            return scores.topk(k, dim=-1).indices
        if visible is None:
            visible = entries_visible(positions, N, self.ratio)  # (T, N)
        visible = visible.expand(B, T, N)
        picks = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices  # (B, T, k)
        return torch.where(visible.gather(-1, picks), picks, torch.full_like(picks, -1))


def chosen_entries_bias(picks: torch.Tensor, n_entries: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias (B, T, N): 0 on the entries in picks (B, T, k), -inf elsewhere (-1: none)."""
    B, T, _ = picks.shape
    safe = torch.where(picks >= 0, picks, torch.full_like(picks, n_entries))
    bias = torch.full((B, T, n_entries + 1), float("-inf"), dtype=dtype, device=picks.device)
    return bias.scatter_(-1, safe, 0.0)[..., :n_entries]
