"""Recurrent sequence mixers over a row split into segments held by different ranks (context
parallelism's ring kind): a chunked scan across the shards.

Each mixer here is affine in its state: from a state S_in, segment s ends in M_s S_in + S_s
and outputs o_s + R_s(S_in), where S_s and o_s are what it gives from zero. Every rank runs
its segments from zero, gathers every segment's (M, S), scans them in the row's order (cheap:
one small product per segment) and corrects its outputs by R_s of the state it starts from.
- The delta rules (Gated DeltaNet; Kimi Delta Attention, whose decay is a vector over the key
  channels): M_s is dk x dk. One run of the rule gives all four: the values widened by dk zero
  columns and the initial state by the identity (each of the state's columns evolves on its
  own, whatever the decay), so the widened outputs are o_s and R_s's matrix side by side.
- Mamba-2: M_s is a number per head, the product of the segment's decays
  (mamba2_scan.py `state_reach`), and R_s reads S_in through each token's C, scaled by the
  decay from the segment's start to the token.
A document that starts where a segment starts does not inherit the previous segment's state,
one that starts inside it cuts the segment's M and R to zero from there, and the short
convolutions read the K - 1 inputs before a segment from the rank that holds them, hidden
where they are another document's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from forja.models.common.mamba2_scan import read_state, state_reach
from forja.parallel.cp.comm import all_gather
from forja.parallel.cp.layout import SequenceLayout

# What one segment's run gives: its outputs from zero, R (a start state -> what it adds to
# them), its transition M (B, H, a, a) (a = 1: a number per head) and its end state S from zero.
Run = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]


def gated_delta_across(mixer: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                       g: torch.Tensor, beta: torch.Tensor, layout: SequenceLayout, document_ids: torch.Tensor | None,
                       group: dist.ProcessGroup) -> torch.Tensor:
    """`mixer` (a Gated DeltaNet or Kimi Delta Attention)'s convolutions and delta rule for this
    rank's tokens (its projections q_in, k_in (B, Tl, Hk dk), v_in (B, Tl, Hv dv), g (B, Tl, Hv)
    or (B, Tl, Hv, dk), beta (B, Tl, Hv)), as if the whole rows were here -> o (B, Tl, Hv, dv).
    `document_ids` (B, T): the whole rows'."""
    inputs = (q_in, k_in, v_in)

    def segment(part: slice, docs: torch.Tensor | None, windows: tuple) -> Run:
        return _delta_segment(mixer, [x[:, part] for x in inputs], g[:, part], beta[:, part], docs, windows)

    return _across(inputs, mixer.conv_q.weight.shape[-1], segment, layout, document_ids, group)


def mamba2_across(mixer: nn.Module, x_in: torch.Tensor, B_in: torch.Tensor, C_in: torch.Tensor, dt: torch.Tensor,
                  layout: SequenceLayout, document_ids: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor:
    """`mixer` (a Mamba2)'s convolutions, scan and skip for this rank's tokens (its projections
    x_in (B, Tl, H P), B_in, C_in (B, Tl, G N), time steps dt (B, Tl, H)), as if the whole rows
    were here -> y (B, Tl, H, P) in the compute dtype. `document_ids` (B, T): the whole rows'."""
    inputs = (x_in, B_in, C_in)

    def segment(part: slice, docs: torch.Tensor | None, windows: tuple) -> Run:
        xs, Bs, Cs, _ = mixer.convolve(*(x[:, part] for x in inputs), docs, windows)
        y, S = mixer.scan(xs, dt[:, part], Bs, Cs, docs)  # (B, c, H, P), (B, H, P, N) from zero
        reach = state_reach(dt[:, part], mixer.decay_rates(xs.dtype), docs)  # (B, c, H)
        return y, lambda start: read_state(Cs, reach, start), reach[:, -1, :, None, None], S

    return _across(inputs, mixer.conv_x.weight.shape[-1], segment, layout, document_ids, group)


def _across(inputs: tuple[torch.Tensor, ...], kernel: int, segment: Callable[..., Run], layout: SequenceLayout,
            document_ids: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor:
    """Runs `segment` on each of this rank's segments (its slice of the rank's tokens, its
    documents, its convolutions' halos), scans every rank's ends in the row's order and
    corrects each segment's outputs by the state it starts from."""
    c, mine = layout.chunk, layout.my_chunks
    windows = _halos(inputs, layout, document_ids, kernel, group)
    runs = []
    for i, a in enumerate(mine):
        docs = document_ids[:, a * c:(a + 1) * c] if document_ids is not None else None
        runs.append(segment(slice(i * c, (i + 1) * c), docs, windows[i]))
    starts = _initial_states(_gather_ends([(M, S) for _, _, M, S in runs], layout, group), layout, document_ids)
    return torch.cat([out + reads(starts[a]).to(out.dtype) for (out, reads, _, _), a in zip(runs, mine)], dim=1)


def _delta_segment(mixer, inputs, g, beta, docs, windows) -> Run:
    """One segment's run of a delta rule from zero and from the identity at once."""
    q, k, v, _ = mixer.convolve(*inputs, docs, windows)  # q, k (B, c, Hk, dk), v (B, c, Hv, dv)
    B, _, Hv, dv = v.shape
    dk = q.shape[-1]
    wide = torch.cat([v.new_zeros(*v.shape[:-1], dk), v], dim=-1)  # (B, c, Hv, dk + dv)
    eye = torch.eye(dk, device=v.device, dtype=torch.float32).expand(B, Hv, dk, dk)
    start = torch.cat([eye, eye.new_zeros(B, Hv, dk, dv)], dim=-1)  # (B, Hv, dk, dk + dv)
    o, S = mixer.delta_rule(q, k, wide, g, beta, initial_state=start, output_final_state=True, document_ids=docs)
    o_M = o[..., :dk].float()  # (B, c, Hv, dk): each output's dependence on the start state
    return o[..., dk:], lambda state: torch.einsum("bthk,bhkv->bthv", o_M, state), S[..., :dk], S[..., dk:]


def _gather_ends(ends: list[tuple[torch.Tensor, torch.Tensor]], layout: SequenceLayout,
                 group: dist.ProcessGroup) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every segment's (M (B, H, a, a), S (B, H, ...)), gathered from every rank, by its chunk."""
    M0, S0 = ends[0]
    flat = torch.stack([torch.cat([M.flatten(2), S.flatten(2)], dim=-1) for M, S in ends])  # (n, B, H, m + s)
    every = all_gather(flat, group)  # (cp, n, B, H, m + s)
    m = M0[0, 0].numel()
    return {a: (x[..., :m].reshape(M0.shape), x[..., m:].reshape(S0.shape))
            for a, x in _by_chunk(every, layout).items()}


def _by_chunk(gathered: torch.Tensor, layout: SequenceLayout) -> dict[int, torch.Tensor]:
    """Each rank's gathered pieces (cp, n, ...) by the chunk of the row they belong to."""
    return {a: gathered[r, i] for r in range(layout.cp) for i, a in enumerate(layout.chunks_of(r))}


def _initial_states(ends: dict, layout: SequenceLayout, document_ids: torch.Tensor | None) -> dict:
    """The state each chunk starts from: zero for the first, then M S_in + S of the one
    before, unless a document starts exactly at the chunk."""
    c = layout.chunk
    state = torch.zeros_like(ends[0][1])  # (B, H, ...)
    starts = {0: state}
    for a in range(1, layout.n_chunks):
        M, S = ends[a - 1]
        # a 1 x 1 transition is a number per head (Mamba-2's decay; a delta rule's with dk = 1 alike)
        state = (M * state if M.shape[-2:] == (1, 1) else M @ state) + S
        if document_ids is not None:
            carries = (document_ids[:, a * c] == document_ids[:, a * c - 1]).to(state.dtype)  # (B,)
            state = state * carries.view(-1, *[1] * (state.dim() - 1))
        starts[a] = state
    return starts


def _halos(inputs, layout: SequenceLayout, document_ids, K: int, group) -> list[tuple]:
    """For each of this rank's segments, the K - 1 convolution inputs before it (zeros before
    the row, and where they belong to another document than the segment's first token)."""
    c, mine, w = layout.chunk, layout.my_chunks, K - 1
    tails = torch.stack([torch.cat([x[:, (i + 1) * c - w:(i + 1) * c] for x in inputs], -1)
                         for i in range(len(mine))])  # (n, B, K - 1, channels of every input)
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
