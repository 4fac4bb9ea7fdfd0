"""Context parallelism of forja's own, on any backend: each row of a micro-batch split over
the `parallel.cp` ranks of a cp group, every sequence mixer seeing the whole row.

`parallel.cp_kind` chooses how:
- "all-to-all" (Ulysses; Jacobs et al. 2023, "DeepSpeed Ulysses"): rank r holds the r-th
  chunk of each row; a mixer's inputs are re-sharded from the sequence to the heads (one
  all-to-all each), it runs unchanged on whole rows for cp-th of the heads (SDPA,
  FlexAttention, windows, sinks, document masks, latent attention, Gated DeltaNet, Kimi Delta
  Attention, Mamba-2), and its output goes back. Key/value heads (Mamba-2's groups) fewer than
  cp are repeated so each rank gets one.
- "ring" (ring.py): rank r holds chunks r and 2 cp - 1 - r of 2 cp; keys and values pass
  around the ranks with an online-softmax merge; the recurrent mixers (Gated DeltaNet, Kimi
  Delta Attention, Mamba-2) scan across the shards (scan.py).

The engine splits each micro-batch (`ContextParallel.split`): tokens, labels, their
positions (RoPE turns each token by its true place) and document ids; the model is handed a
`ContextShards` (models/common/attention.py `SequenceShards`) that makes each kind of
block's mask once per forward. FSDP shards parameters over dp_shard x cp, and the loss is
averaged over both (forja/parallel/dims.py): a cp group sees one batch, in pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from forja import fallbacks
from forja.eager import eager_only
from forja.models.common.attention import AttentionMask, attend, build_mask, rescale_for_sinks
from forja.models.common.sparse_attention import head_summed_probs
from forja.parallel.cp.comm import RingExchange, all_gather, all_to_all, heads_to_sequence, sequence_to_heads
from forja.parallel.cp.compressed import CompressedMixing
from forja.parallel.cp.layout import SequenceLayout
from forja.parallel.cp.ring import RingPlan, ring_attention, ring_probs
from forja.parallel.cp.scan import gated_delta_across, mamba2_across

__all__ = ["ContextParallel", "LocalPart", "SequenceLayout"]


@dataclass
class LocalPart:
    """This rank's part of a micro-batch: tokens, labels (B, Tl), their document ids (B, Tl)
    or None, positions (Tl,) in the row, and the whole rows' description for the model."""

    tokens: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None
    positions: torch.Tensor
    sequence: ContextShards | None


class ContextParallel:
    """Splits micro-batches over a cp group (`group`: this rank's; `kind`: cp_kind; `device`:
    the ranks' device, for the fallback record)."""

    def __init__(self, group: dist.ProcessGroup, kind: str, device: torch.device | None = None):
        self.group, self.kind = group, kind
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.exchange = RingExchange(group) if kind == "ring" else None
        if kind == "ring" and device is not None and device.type == "cuda":  # decided once, here
            fallbacks.record("cp.ring", asked='parallel.cp_kind = "ring"',
                             instead="ring attention with its blocks as fp32 PyTorch matmuls",
                             why="forja's ring has no fused flash-attention block kernel yet",
                             fix='parallel.cp_kind = "all-to-all" runs the fused attention kernels on whole rows')
        self._documents = False  # whether the rows a pipeline's stages get (`split_rows`) are documents

    def split(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None) -> LocalPart:
        """This rank's part of a micro-batch of whole rows (B, T), the same on every rank of the group."""
        layout = SequenceLayout(self.kind, self.cp, self.rank, tokens.shape[1])
        local_docs = layout.take(document_ids) if document_ids is not None else None
        shards = ContextShards(self, layout, document_ids, local_docs, tokens.device, rows=tokens.shape[0])
        return LocalPart(layout.take(tokens), layout.take(labels), local_docs, layout.positions(tokens.device), shards)

    # -- under pipeline parallelism ----------------------------------------------------------
    # The schedule cuts a step's rows into micro-batches and hands each stage its tensors only,
    # so the rows' documents travel as one more keyword tensor, `cp_rows` (B, T), and a
    # forward pre-hook on each stage (`stage_hook`) makes that micro-batch's part from it.
    def split_rows(self, tokens: torch.Tensor, labels: torch.Tensor,
                   document_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens and labels (B, Tl) of a step's rows (B, T), and the `cp_rows` for
        the stages: the rows' document ids, or (B, T) zeros without document masks."""
        layout = SequenceLayout(self.kind, self.cp, self.rank, tokens.shape[1])
        self._documents = document_ids is not None
        rows = document_ids if document_ids is not None else torch.zeros_like(tokens)
        return layout.take(tokens), layout.take(labels), rows

    def stage_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A stage's forward pre-hook: `cp_rows` (a micro-batch's, (b, T)) becomes the model's
        document_ids, positions and sequence. Without it (validation) nothing changes."""
        rows = kwargs.pop("cp_rows", None)
        if rows is None:
            return None
        layout = SequenceLayout(self.kind, self.cp, self.rank, rows.shape[1])
        docs = rows if self._documents else None
        local = layout.take(docs) if docs is not None else None
        kwargs.update(document_ids=local, positions=layout.positions(rows.device),
                      sequence=ContextShards(self, layout, docs, local, rows.device, rows=rows.shape[0]))
        return args, kwargs


class ContextShards:
    """One forward's rows, split (models/common/attention.py `SequenceShards`)."""

    def __init__(self, cp: ContextParallel, layout: SequenceLayout, document_ids: torch.Tensor | None,
                 local_document_ids: torch.Tensor | None, device: torch.device, *, rows: int):
        self.cp, self.layout, self.device, self.rows = cp, layout, device, rows
        self.document_ids, self.local_document_ids = document_ids, local_document_ids

    def within_chunks(self, chunk: int) -> ContextShards:
        T = self.layout.seq_len
        docs = self.document_ids if self.document_ids is not None else torch.zeros(
            self.rows, T, dtype=torch.long, device=self.device)  # (B, T)
        pieces = torch.arange(T, device=self.device) // chunk  # (T,) the chunk of each position
        cut = docs * (T // chunk + 1) + pieces  # (B, T): one id per (document, chunk)
        return ContextShards(self.cp, self.layout, cut, self.layout.take(cut), self.device, rows=self.rows)

    def mask(self, kind: str, *, window: int | None, backend: str, flex_causal: bool) -> AttentionMask:
        docs = self.document_ids
        if kind == "compressed_attention":  # DeepSeek-V4's blocks, one document per row: either kind's layout
            return AttentionMask(sequence=CompressedMixing(self.layout, self.cp.group, window))
        if self.cp.kind == "ring":
            mixing = RingMixing(self, RingPlan(self.layout, self.cp.exchange, docs, window))
        else:
            T = self.layout.seq_len
            whole = AttentionMask(document_ids=docs) if kind == "linear_attention" else build_mask(
                docs, q_len=T, kv_len=T, backend=backend, window=window, device=self.device, flex_causal=flex_causal)
            mixing = UlyssesMixing(self, whole, window)
        return AttentionMask(document_ids=self.local_document_ids, sequence=mixing)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, Tl, ...) this rank's tokens -> (B, T, ...) the whole rows in order (comm.py's
        all_gather: each rank's gradient of a token goes back to the token's rank)."""
        got = all_gather(x, self.cp.group)  # (cp, B, Tl, ...) by rank
        by_rank = got.transpose(0, 1).flatten(1, 2)  # (B, T, ...): rank 0's tokens, then rank 1's...
        if self.cp.kind != "ring":  # a chunk per rank, in rank order: already the row's
            return by_rank
        c, layout = self.layout.chunk, self.layout
        held = torch.cat([torch.arange(a * c, (a + 1) * c) for r in range(self.cp.cp) for a in layout.chunks_of(r)])
        return by_rank.index_select(1, torch.argsort(held).to(x.device))  # (B, T, ...) in row order

    def visible_keys(self, device: torch.device, window: int | None) -> torch.Tensor:
        """(B or 1, Tl, T) bool: the whole rows' keys each of this rank's queries may see
        (causal, within `window` and its document)."""
        q_pos = self.layout.positions(device)[:, None]
        k_pos = torch.arange(self.layout.seq_len, device=device)[None, :]
        allowed = q_pos >= k_pos  # (Tl, T)
        if window is not None:
            allowed = allowed & (q_pos - k_pos < window)
        allowed = allowed[None]  # (1, Tl, T)
        if self.document_ids is not None:
            local, docs = self.local_document_ids.to(device), self.document_ids.to(device)
            allowed = allowed & (local[:, :, None] == docs[:, None, :])  # (B, Tl, T)
        return allowed


class UlyssesMixing:
    """A mixer on whole rows for this rank's cp-th of the heads (all-to-all)."""

    def __init__(self, shards: ContextShards, whole: AttentionMask, window: int | None):
        self.shards, self.whole, self.window = shards, whole, window
        self.group, self.cp, self.rank = shards.cp.group, shards.cp.cp, shards.cp.rank

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v (B, n, Tl, d) -> (B, n / cp, T, d): the whole rows of this rank's heads."""
        if k.shape[1] % self.cp:  # fewer key/value heads than ranks: each rank gets one
            repeat = self.cp // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return tuple(sequence_to_heads(t, self.group) for t in (q, k, v))

    @eager_only
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self._heads(q, k, v)  # (B, heads / cp, T, d)
        if sinks is not None:
            sinks = _local(sinks).chunk(self.cp)[self.rank]
        out = attend(q, k, v, self.whole, scale=scale, sinks=sinks)  # (B, H / cp, T, dv)
        return heads_to_sequence(out, self.group)  # (B, H, Tl, dv)

    @eager_only
    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.gather_rows(x)

    def visible_keys(self, device: torch.device) -> torch.Tensor:
        return self.shards.visible_keys(device, self.window)

    @eager_only
    def attend_selected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                        selected: bool, scale: float, probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole rows' selection (every rank's queries') gathered: this rank's heads attend
        under it as one process would; the probabilities' head sums are added over the ranks."""
        q, k, v = self._heads(q, k, v)  # (B, H / cp, T, d)
        if selected or probs:
            with torch.no_grad():
                keep = self.shards.gather_rows(keep.to(torch.uint8)).bool()  # (B or 1, T, T)
        out = attend(q, k, v, AttentionMask(dense=keep[:, None]) if selected else self.whole, scale=scale)
        summed = None
        if probs:
            with torch.no_grad():
                mine = head_summed_probs(q, k, keep, scale)  # (B, T, T): this rank's heads' share
                B, T, _ = mine.shape
                # (cp, B, Tl, T): the rows of chunk j go to rank j, which adds up every rank's share
                pieces = mine.view(B, self.cp, T // self.cp, T).transpose(0, 1).contiguous()
                summed = all_to_all(pieces, self.group).sum(0)  # (B, Tl, T): every head's, for these queries
        return heads_to_sequence(out, self.group), summed

    @eager_only
    def gated_delta(self, mixer: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        dk, dv = mixer.head_k_dim, mixer.head_v_dim
        keys = _share(q_in.shape[-1], self.cp, self.rank)
        values = _share(v_in.shape[-1], self.cp, self.rank)
        q_in, k_in = self._whole_rows(q_in, dk), self._whole_rows(k_in, dk)  # (B, T, Hk / cp * dk)
        v_in, beta = self._whole_rows(v_in, dv), self._whole_rows(beta, 1)  # beta (B, T, Hv / cp)
        # g (B, T, Hv / cp), or (B, T, Hv / cp, dk) where the decay is per key channel (KDA)
        g = self._whole_rows(g.flatten(2), g.shape[-1] if g.dim() == 4 else 1).view(*beta.shape, *g.shape[3:])
        # (B, T, Hv / cp, dv)
        o, _ = mixer.mix(q_in, k_in, v_in, g, beta, self.whole.document_ids, channels=(keys, values))
        return heads_to_sequence(o.transpose(1, 2), self.group).transpose(1, 2)  # (B, Tl, Hv, dv)

    @eager_only
    def mamba2(self, mixer: nn.Module, x_in: torch.Tensor, B_in: torch.Tensor, C_in: torch.Tensor,
               dt: torch.Tensor) -> torch.Tensor:
        P, N = mixer.head_dim, mixer.state_size
        groups = B_in.shape[-1] // N
        if groups % self.cp:  # fewer groups than ranks: each rank gets the one its heads read
            B_in, C_in = (t.unflatten(-1, (groups, N)).repeat_interleave(self.cp // groups, dim=2).flatten(2)
                          for t in (B_in, C_in))
        heads = _share(dt.shape[-1], self.cp, self.rank)
        x_in, dt = self._whole_rows(x_in, P), self._whole_rows(dt, 1)  # (B, T, H / cp * P), (B, T, H / cp)
        B_in, C_in = self._whole_rows(B_in, N), self._whole_rows(C_in, N)  # (B, T, G / cp * N)
        y, _ = mixer.mix(x_in, B_in, C_in, dt, self.whole.document_ids, heads=heads)  # (B, T, H / cp, P)
        return heads_to_sequence(y.transpose(1, 2), self.group).transpose(1, 2)  # (B, Tl, H, P)

    def _whole_rows(self, x: torch.Tensor, d: int) -> torch.Tensor:
        """x (B, Tl, n d), this rank's tokens of n heads -> (B, T, n / cp * d)."""
        B, Tl, C = x.shape
        heads = sequence_to_heads(x.view(B, Tl, C // d, d).transpose(1, 2), self.group)  # (B, n / cp, T, d)
        return heads.transpose(1, 2).reshape(B, Tl * self.cp, -1)


def _share(width: int, cp: int, rank: int) -> slice:
    """The channels of heads this rank holds after the all-to-all: its cp-th of `width`."""
    return slice(rank * width // cp, (rank + 1) * width // cp)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local values (a DTensor's shard under tensor parallelism)."""
    return t.to_local() if hasattr(t, "to_local") else t


class RingMixing:
    """A mixer on this rank's two chunks of each row, the rest passed around the ring."""

    def __init__(self, shards: ContextShards, plan: RingPlan):
        self.shards, self.plan = shards, plan

    @eager_only
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
        out, lse = ring_attention(q, k, v, self.plan, scale, sinks=sinks is not None)  # (B, H, Tl, dv), (B, H, Tl)
        return out if sinks is None else rescale_for_sinks(out, lse, _local(sinks))

    @eager_only
    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.gather_rows(x)

    def visible_keys(self, device: torch.device) -> torch.Tensor:
        return self.shards.visible_keys(device, self.plan.window)

    @eager_only
    def attend_selected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                        selected: bool, scale: float, probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each ring block masked by this rank's queries' selection; the probabilities from the
        merged log-sum-exp, the keys taken round once more."""
        plan = dataclasses.replace(self.plan, selection=keep) if selected else self.plan
        out, lse = ring_attention(q, k, v, plan, scale)  # (B, H, Tl, dv), (B, H, Tl)
        return out, ring_probs(q, k, lse, plan, scale) if probs else None

    @eager_only
    def gated_delta(self, mixer: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        shards = self.shards
        return gated_delta_across(mixer, q_in, k_in, v_in, g, beta, shards.layout, shards.document_ids,
                                  shards.cp.group)

    @eager_only
    def mamba2(self, mixer: nn.Module, x_in: torch.Tensor, B_in: torch.Tensor, C_in: torch.Tensor,
               dt: torch.Tensor) -> torch.Tensor:
        shards = self.shards
        return mamba2_across(mixer, x_in, B_in, C_in, dt, shards.layout, shards.document_ids, shards.cp.group)
