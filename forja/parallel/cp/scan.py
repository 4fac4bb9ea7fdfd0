"""Gated DeltaNet over a row split into segments held by different ranks (context
parallelism's ring kind): a chunked scan across the shards.

The delta rule is linear in its state: from a state S_in, segment s ends in
M_s S_in + S_s and outputs o_s + o_M,s S_in, where S_s and o_s are what it gives from zero,
M_s (dk x dk) its transition and o_M,s its outputs' dependence on S_in. One run of the rule
gives all four: the values widened by dk zero columns and the initial state by the identity
(each of the state's columns evolves on its own). Every rank runs its segments so, gathers
every segment's (M, S), scans them in the row's order (cheap: a product of small matrices
per segment) and corrects its outputs. A document that starts where a segment starts does
not inherit the previous segment's state, and the short convolutions read the K - 1 inputs
before a segment from the rank that holds them, hidden where they are another document's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from forja.models.common.gated_delta_rule import gated_delta_rule
from forja.parallel.cp.comm import all_gather
from forja.parallel.cp.layout import SequenceLayout


def gated_delta_across(mixer: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                       g: torch.Tensor, beta: torch.Tensor, layout: SequenceLayout, document_ids: torch.Tensor | None,
                       group: dist.ProcessGroup) -> torch.Tensor:
    """`mixer` (a GatedDeltaNet)'s convolutions and delta rule for this rank's tokens (its
    projections q_in, k_in (B, Tl, Hk dk), v_in (B, Tl, Hv dv), g, beta (B, Tl, Hv)), as if the
    whole rows were here -> o (B, Tl, Hv, dv). `document_ids` (B, T): the whole rows'."""
    c, mine = layout.chunk, layout.my_chunks
    inputs = (q_in, k_in, v_in)
    windows = _halos(inputs, layout, document_ids, mixer.conv_q.weight.shape[-1], group)
    runs = []
    for i, a in enumerate(mine):
        part = slice(i * c, (i + 1) * c)
        docs = document_ids[:, a * c:(a + 1) * c] if document_ids is not None else None
        runs.append(_segment(mixer, [x[:, part] for x in inputs], g[:, part], beta[:, part], docs, windows[i]))
    # every segment's (transition, state from zero), in the row's order
    # (cp, n, B, Hv, dk, dk + dv)
    ends = all_gather(torch.stack([torch.cat([M, S], dim=-1) for _, _, M, S in runs]), group)
    dk = runs[0][2].shape[-1]
    by_chunk = _by_chunk(ends, layout)
    starts = _initial_states(by_chunk, dk, layout, document_ids)
    outs = [o + torch.einsum("bthk,bhkv->bthv", o_M, starts[a]).to(o.dtype) for (o, o_M, _, _), a in zip(runs, mine)]
    return torch.cat(outs, dim=1)


def _by_chunk(gathered: torch.Tensor, layout: SequenceLayout) -> dict[int, torch.Tensor]:
    """Each rank's gathered pieces (cp, n, ...) by the chunk of the row they belong to."""
    return {a: gathered[r, i] for r in range(layout.cp) for i, a in enumerate(layout.chunks_of(r))}


def _segment(mixer, inputs, g, beta, docs, windows):
    """One segment's run from zero and from the identity at once -> (o, o_M, M, S)."""
    q, k, v, _ = mixer.convolve(*inputs, docs, windows)  # q, k (B, c, Hk, dk), v (B, c, Hv, dv)
    B, _, Hv, dv = v.shape
    dk = q.shape[-1]
    wide = torch.cat([v.new_zeros(*v.shape[:-1], dk), v], dim=-1)  # (B, c, Hv, dk + dv)
    eye = torch.eye(dk, device=v.device, dtype=torch.float32).expand(B, Hv, dk, dk)
    start = torch.cat([eye, eye.new_zeros(B, Hv, dk, dv)], dim=-1)  # (B, Hv, dk, dk + dv)
    o, S = gated_delta_rule(q, k, wide, g, beta, chunk_size=mixer.chunk_size, initial_state=start,
                            output_final_state=True, document_ids=docs)
    return o[..., dk:], o[..., :dk].float(), S[..., :dk], S[..., dk:]


def _initial_states(by_chunk: dict, dk: int, layout: SequenceLayout, document_ids: torch.Tensor | None) -> dict:
    """The state each chunk starts from: zero for the first, then M S_in + S of the one
    before, unless a document starts exactly at the chunk."""
    c = layout.chunk
    first = by_chunk[0]
    state = first.new_zeros(*first.shape[:-1], first.shape[-1] - dk)  # (B, Hv, dk, dv)
    starts = {0: state}
    for a in range(1, layout.n_chunks):
        prev = by_chunk[a - 1]
        state = prev[..., :dk] @ state + prev[..., dk:]
        if document_ids is not None:
            carries = (document_ids[:, a * c] == document_ids[:, a * c - 1]).to(state.dtype)  # (B,)
            state = state * carries.view(-1, 1, 1, 1)
        starts[a] = state
    return starts


def _halos(inputs, layout: SequenceLayout, document_ids, K: int, group) -> list[tuple]:
    """For each of this rank's segments, the K - 1 convolution inputs before it (zeros before
    the row, and where they belong to another document than the segment's first token)."""
    c, mine, w = layout.chunk, layout.my_chunks, K - 1
    tails = torch.stack([torch.cat([x[:, (i + 1) * c - w:(i + 1) * c] for x in inputs], -1)
                         for i in range(len(mine))])  # (n, B, K - 1, channels of q, k, v)
    every = all_gather(tails, group)  # (cp, n, B, K - 1, C)
    tail_of = _by_chunk(every, layout)
    widths = [x.shape[-1] for x in inputs]
    halos = []
    for a in mine:
        halo = tail_of[a - 1] if a > 0 else torch.zeros_like(tail_of[a])
        if a > 0 and document_ids is not None:
            same = document_ids[:, a * c - w:a * c] == document_ids[:, a * c:a * c + 1]  # (B, K - 1)
            halo = halo * same[..., None].to(halo.dtype)
        halos.append(tuple(halo.split(widths, dim=-1)))
    return halos

