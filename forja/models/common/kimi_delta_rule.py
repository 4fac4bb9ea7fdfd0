"""The channel-wise gated delta rule of Kimi Delta Attention (Kimi Team 2025, "Kimi Linear:
An Expressive, Efficient Attention Architecture", arXiv 2510.26692), as pure functions on
tensors: the PyTorch reference (fp32 math inside, fp64 for fp64 inputs; any device) and a
dispatch to flash-linear-attention's `chunk_kda` kernel on CUDA.

It is the gated delta rule of forja/models/common/gated_delta_rule.py with one change: the
decay is a vector over the key channels, not one number per head. Per head, with
Diag(a) the diagonal matrix of a, the state S (dk, dv) is decayed row by row, corrected
towards the new value and read:

    S_t = Diag(exp(g_t)) S_{t-1}                      g_t (dk,): log decay, <= 0
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T q_t

with q, k L2-normalized and q scaled by 1/sqrt(dk), as transformers' Kimi Linear and fla's
kernel compute it. `recurrent_kimi_delta_rule` runs it token by token (decoding);
`chunk_kimi_delta_rule` a chunk at a time: the WY representation condenses the corrections
within a chunk into one triangular solve, as for the scalar rule, but the decay between two
tokens i >= j of a chunk, exp(gc_i - gc_j) per channel, no longer factors into a number per
row times one per column, so the intra-chunk scores q_i.k_j and k_i.k_j are contracted
through a (C, C, dk) tensor of those decays (each entry <= 1: no overflow, whatever the
gates). Its size is why the default chunk here is 16, not 64; the reads and writes of the
state across chunks only use decays from a chunk's start or to its end, all <= 1 too.

Packed documents (`document_ids` (B, T)) are kept apart exactly as for the scalar rule
(the same layout helpers): each document padded to whole chunks, the state zeroed where a
document starts; padding tokens have k = v = beta = g = 0 and leave the state as it is.
"""

from __future__ import annotations

import torch

from forja.models.common.gated_delta_rule import (
    across_chunks,
    chunked,
    fastest,
    gated_delta_rule_flops,
    recurrent_gated_delta_rule,
)
from forja.models.common.precision import at_least_fp32

DEFAULT_CHUNK = 16
"""The reference's chunk: its (C, C, dk) decay tensor grows with C (fla's kernel uses its own)."""


# One token at a time the channel-wise rule is the scalar one with g (B, T, H, dk): the decay
# broadcasts over each key channel's row of the state.
recurrent_kimi_delta_rule = recurrent_gated_delta_rule


def chunk_kimi_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    chunk_size: int = DEFAULT_CHUNK, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The channel-wise gated delta rule a chunk of `chunk_size` tokens at a time. q, k, g (log
    decay, <= 0) (B, T, H, dk); v (B, T, H, dv); beta (B, T, H); initial_state (B, H, dk, dv)
    -> o (B, T, H, dv) in q's dtype, and the final state (B, H, dk, dv) fp32 when asked. T need
    not be a multiple of chunk_size."""
    return chunked(_chunk_scan, q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                   output_final_state=output_final_state, document_ids=document_ids)


def _chunk_scan(q, k, v, g, beta, C: int, S: torch.Tensor | None, keep: torch.Tensor | None):
    """q, k, g (B, H, T, dk), v (B, H, T, dv), beta (B, H, T), T a multiple of C; keep
    (B, T / C): 0 where a chunk starts a document. -> o (B, H, T, dv), the final state."""
    B, H, T, dk = k.shape
    dv, N = v.shape[-1], T // C
    q, k, v, g = (t.reshape(B, H, N, C, -1) for t in (q, k, v, g))  # (B, H, N, C, d)
    beta = beta.reshape(B, H, N, C)
    gc = g.cumsum(-2)  # (B, H, N, C, dk) log decay from the chunk's start through each position
    # decay[i, j, d] = exp(gc_i - gc_j) for j <= i, 0 above the diagonal (-inf before exp).
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(upper[..., None], float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + A) U = V with A[i, j] = beta_i sum_d k_i[d] k_j[d] decay[i, j, d], j < i; the
    # unitriangular solve reads only the strictly lower part of `system`.
    # At least fp32 whatever the einsum's (bf16 under autocast): the triangular solve has no bf16 kernel.
    system = at_least_fp32(torch.einsum("bhnijd,bhnjd->bhnij", decay * k_beta[..., :, None, :], k))  # (B, H, N, C, C)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp(), upper=False, unitriangular=True)
    attn = torch.einsum("bhnijd,bhnjd->bhnij", decay * q[..., :, None, :], k)  # causal, diagonal included
    q_read = q * gc.exp()  # reads the state as it stood before the chunk
    k_write = k * (gc[..., -1:, :] - gc).exp()  # decayed to the chunk's end
    chunk_decay = gc[..., -1, :].exp()[..., None]  # (B, H, N, dk, 1): each state row's decay over the chunk
    S = q.new_zeros(B, H, dk, dv) if S is None else S.to(q.dtype)
    return across_chunks(u, w, q_read, attn, k_write, chunk_decay, S, keep)


def kimi_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    chunk_size: int = DEFAULT_CHUNK, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The channel-wise gated delta rule by the fastest form here: fla's `chunk_kda` on CUDA
    when installed; otherwise the recurrent form for one token (decoding) and the chunked
    reference for more. Arguments and results as `chunk_kimi_delta_rule`."""
    fallback = dict(key="kimi_delta_attention.fla", asked="Kimi Delta Attention layers on CUDA",
                    instead="the PyTorch chunked channel-wise delta rule",
                    why="flash-linear-attention (fla) with its KDA kernel is not installed")
    return fastest(("fla.ops.kda", "chunk_kda"), fallback, chunk_kimi_delta_rule, q, k, v, g, beta,
                   chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state,
                   document_ids=document_ids)


def kimi_delta_rule_flops(n_heads: int, head_dim: int, seq_len: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Training FLOPs per token (3 x forward) of the chunked channel-wise rule, beyond the
    projections and convolutions that 6 N counts. The same matrix products as the scalar
    rule (`gated_delta_rule_flops`): the intra-chunk scores contract the same C x dk
    products per token, their decays folded into one operand; the decays themselves are
    elementwise work, not counted."""
    return gated_delta_rule_flops(n_heads, head_dim, head_dim, seq_len, chunk)
