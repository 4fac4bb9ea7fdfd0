"""DeepSeek-V4's compressed attention (forja/models/common/compressed_attention.py) on a row
split over the context-parallel ranks, exactly as on whole rows, under either kind's layout.

Each rank keeps its queries, all heads: the attention reads one shared key/value head, so
re-sharding by heads (all-to-all) would move the queries and still hand every rank the whole
key/value row, and passing keys around a ring would move the row too; a query reads little
of it. What a rank's chunk (positions a c .. (a + 1) c - 1) needs from the others is:

- the window: the one key/value head of the `window - 1` positions before the chunk;
- the compressed entries of the whole row (N = T / ratio, each one head wide), and CSA's
  indexer keys likewise: each rank pools the windows that end in its chunks (the compressor's
  projections of the `ratio - 1` positions before a chunk, and for CSA's overlapping windows
  `ratio` more, come from the rank holding them), and the entries are all-gathered.

Positions before a chunk ("halos") are all-gathered as every chunk's last ones, `n` of them or
the whole chunk when `n` is longer (several chunks back); the all-gathers' backward sums every
rank's gradient into the owner's. The indexer's picks and each query's visible entries depend
only on its own position, so they run on the rank's queries as they are. Memory per rank: its
queries' scores over (window - 1 + chunk + N) keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from forja.eager import eager_only
from forja.parallel.cp.comm import all_gather
from forja.parallel.cp.layout import SequenceLayout


class CompressedMixing:
    """Compressed attention on this rank's chunks of the rows (`layout`), over the cp `group`;
    `window`: the sliding window (None: every earlier position)."""

    def __init__(self, layout: SequenceLayout, group: dist.ProcessGroup, window: int | None):
        self.layout, self.group, self.window = layout, group, window

    @eager_only
    def compressed_attention(self, mixer: nn.Module, x: torch.Tensor, q_latent: torch.Tensor, q: torch.Tensor,
                             kv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """`mixer` (a CompressedAttention) for this rank's tokens: x (B, Tl, dim), q_latent
        (B, Tl, r), q (B, H, Tl, hd), kv (B, 1, Tl, hd) rotated, rope and positions (Tl,) the
        tokens' -> (B, H, Tl, hd), before `attend`'s output is un-rotated (as `mixer.attend`)."""
        entries, entry_bias = None, None
        if mixer.compressor is not None:
            entries = self._entries(mixer.compressor, x)  # (B, N, hd)
            keys = None
            if mixer.indexer is not None:  # its keys only rank entries (top-k): no gradient to pass
                with torch.no_grad():
                    keys = self._entries(mixer.indexer.compressor, x)
            entry_bias = mixer.entry_bias(x, q_latent, rope, positions, entries.shape[1], keys)  # (B, Tl, N)
        c, reach = self.layout.chunk, self._reach()
        halos = self._before(kv[:, 0], reach)  # per chunk (B, reach, hd)
        outs = []
        for i, a in enumerate(self.layout.my_chunks):
            part = slice(i * c, (i + 1) * c)
            keys = torch.cat([halos[i], kv[:, 0, part]], dim=1)  # (B, reach + c, hd): positions a c - reach ..
            bias = self._window_bias(positions[part], a * c - reach, reach + c).expand(q.shape[0], -1, -1)
            if entries is not None:
                keys, bias = torch.cat([keys, entries], dim=1), torch.cat([bias, entry_bias[:, part]], dim=-1)
            outs.append(mixer.attend(q[:, :, part], keys.unsqueeze(1), bias))  # (B, H, c, hd)
        return torch.cat(outs, dim=2)

    def _reach(self) -> int:
        """Keys before a chunk that its queries may see: window - 1 (all before it without a window)."""
        last = self.layout.seq_len - self.layout.chunk  # the latest chunk's start
        return last if self.window is None else min(self.window - 1, last)

    def _window_bias(self, q_pos: torch.Tensor, first: int, n_keys: int) -> torch.Tensor:
        """(1, c, n_keys) additive: 0 where the query at q_pos (c,) sees the key at first + j
        (causal, within the window, inside the row), -inf elsewhere."""
        k_pos = torch.arange(first, first + n_keys, device=q_pos.device)[None, :]
        seen = (k_pos <= q_pos[:, None]) & (k_pos >= 0)
        if self.window is not None:
            seen &= q_pos[:, None] - k_pos < self.window
        return torch.zeros(seen.shape, device=q_pos.device).masked_fill(~seen, float("-inf"))[None]

    def _entries(self, compressor: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The whole rows' compressed entries (B, N, hd), N = T // ratio: each rank pools the
        windows ending in its chunks, from its projections and the positions just before."""
        m, c, hd = compressor.ratio, self.layout.chunk, compressor.head_dim
        kv, gate = compressor.project(x)  # (B, Tl, width) each
        width = kv.shape[-1]
        projections = torch.cat([kv, gate], dim=-1)  # (B, Tl, 2 width)
        lead = m - 1 + (m if compressor.overlap else 0)  # a window's start, and the overlap's window before
        halos = self._before(projections, lead)  # per chunk (B, lead, 2 width)
        pieces = []
        for i, a in enumerate(self.layout.my_chunks):
            w0, w1 = a * c // m, (a + 1) * c // m  # the windows ending in this chunk
            span = torch.cat([halos[i], projections[:, i * c:(i + 1) * c]], dim=1)  # positions a c - lead ..
            at = a * c - lead  # the position of span's first token
            proj_kv, proj_gate = span[:, w0 * m - at:w1 * m - at].split(width, dim=-1)
            prev = None
            if compressor.overlap and w0 > 0:  # the window before's Ca and gate (its position bias on)
                before = span[:, (w0 - 1) * m - at:w0 * m - at]
                prev = (before[..., :hd], (before[..., width:] + compressor.position_bias)[..., :hd])
            pieces.append(compressor.pool(proj_kv, proj_gate, w0 * m, prev)[0])  # (B, w1 - w0, hd)
        return self._row(pieces, [(a + 1) * c // m - a * c // m for a in range(self.layout.n_chunks)])

    def _before(self, x: torch.Tensor, n: int) -> list[torch.Tensor]:
        """For each of this rank's chunks, x's n positions before it (B, n, C), zeros before the
        row; x (B, Tl, C) is this rank's tokens. Every chunk's halo is cut from the one gathered
        tensor, so every rank's backward runs the gather's (a collective) even where no halo is
        read (the row's first chunk)."""
        c, mine = self.layout.chunk, self.layout.my_chunks
        if n == 0:
            return [x[:, :0] for _ in mine]
        t = min(n, c)  # each chunk's last t positions: the one before's tail, or whole chunks
        tails = torch.stack([x[:, (i + 1) * c - t:(i + 1) * c] for i in range(len(mine))])  # (k, B, t, C)
        tail_of = self._by_chunk(all_gather(tails, self.group))
        zeros = x.new_zeros(x.shape[0], n, x.shape[2])
        ordered = torch.cat([zeros, *(tail_of[b] for b in range(self.layout.n_chunks))], dim=1)  # (B, n + 2cp t, C)
        return [ordered[:, a * t:a * t + n] for a in mine]  # ends where chunk a - 1's tail ends

    def _row(self, pieces: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
        """The whole rows (B, sum of counts, C) from each chunk's piece (B, counts[a], C), this
        rank's `pieces` in its chunks' order: padded to one length, all-gathered, trimmed."""
        longest = max(counts)
        if longest == 0:  # rows shorter than one window: no entries anywhere
            return pieces[0]
        padded = torch.stack([torch.cat([p, p.new_zeros(p.shape[0], longest - p.shape[1], p.shape[2])], dim=1)
                              for p in pieces])  # (k, B, longest, C)
        piece_of = self._by_chunk(all_gather(padded, self.group))
        return torch.cat([piece_of[a][:, :counts[a]] for a in range(self.layout.n_chunks)], dim=1)

    def _by_chunk(self, gathered: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every rank's gathered pieces (cp, k, ...) by the chunk of the row they belong to."""
        return {a: gathered[r, i] for r in range(self.layout.cp) for i, a in enumerate(self.layout.chunks_of(r))}
