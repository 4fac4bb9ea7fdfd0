"""The gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks"), as pure
functions on tensors: the PyTorch reference (fp32 math inside, fp64 for fp64 inputs; any
device) and a dispatch to flash-linear-attention's kernel on CUDA.

Per head, a state S (dk, dv) is decayed, corrected towards the new value and read:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

with q, k L2-normalized and q scaled by 1/sqrt(dk) (as transformers' Qwen3.5 and
OLMo-Hybrid layers call it: `use_qk_l2norm_in_kernel=True`). `recurrent_gated_delta_rule`
runs it token by token (decoding); `chunk_gated_delta_rule` runs it a chunk at a time, the
corrections inside a chunk condensed by the WY representation into one triangular solve
(Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length"), so the sequential part is T / chunk_size steps of matrix products.

Packed documents (`document_ids` (B, T)): the state does not flow from one document into
the next. The chunked form lays each row out again with every document padded to a whole
number of chunks (at most chunk_size - 1 padding tokens per document), so no chunk holds
two documents, and zeroes the state before each chunk that starts a document; padding
tokens have k = v = beta = g = 0 and leave the state as it is. The recurrent form zeroes
the state at each document's first token. With an `initial_state` the row's first document
continues from it (a document carried on from a cache).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from forja import fallbacks
from forja.models.common.precision import at_least_fp32

_NORM_EPS = 1e-6  # the L2 norm's epsilon, as in transformers' reference and fla's kernel


def l2_normalize(x: torch.Tensor, eps: float = _NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta):
    """At least fp32, heads before time, q/k repeated to the value heads, normalized and q scaled.
    q, k (B, T, Hk, dk); v (B, T, Hv, dv); g, beta (B, T, Hv) -> (B, Hv, T, ...)."""
    group = v.shape[2] // k.shape[2]
    if group > 1:  # each q/k head serves `group` consecutive value heads
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k, v, g, beta = (at_least_fp32(t.transpose(1, 2)) for t in (q, k, v, g, beta))
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    return q, l2_normalize(k), v, g, beta


def _new_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True at the first token of each document of a row (t = 0 included)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts



def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule one token at a time. q, k (B, T, Hk, dk); v (B, T, Hv, dv);
    g (log decay, <= 0) (B, T, Hv), or (B, T, Hv, dk) for a decay per key channel (Kimi's:
    forja/models/common/kimi_delta_rule.py); beta (B, T, Hv); initial_state (B, Hv, dk, dv)
    -> o (B, T, Hv, dv) in q's dtype, and the final state (B, Hv, dk, dv) fp32 (fp64 for fp64 q) when asked."""
    dtype = q.dtype
    B, T, H, dv = v.shape
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # (B, H, T, ...)
    S = q.new_zeros(B, H, q.shape[-1], dv) if initial_state is None else initial_state.to(q.dtype)
    keep = None if document_ids is None else (~_new_documents(document_ids)).float()  # (B, T)
    out = []
    for t in range(T):
        if keep is not None and t > 0:
            S = S * keep[:, t].view(B, 1, 1, 1)  # a new document starts from zero
        S = S * g[:, :, t].exp().view(B, H, -1, 1)  # (B, H, dk, dv): per head, or per key channel
        k_t = k[:, :, t]  # (B, H, dk)
        remembered = torch.einsum("bhkv,bhk->bhv", S, k_t)  # what S already gives for k_t
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]  # (B, H, dv)
        S = S + k_t[..., None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, dv)  # (B, T, H, dv)
    return o.to(dtype), (S if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule a chunk of `chunk_size` tokens at a time; the same arguments and
    results as `recurrent_gated_delta_rule` (g per head). T need not be a multiple of chunk_size."""
    return chunked(_chunk_scan, q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                   output_final_state=output_final_state, document_ids=document_ids)


def chunked(scan, q, k, v, g, beta, *, chunk_size: int, initial_state: torch.Tensor | None,
            output_final_state: bool, document_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunked delta rule around its `scan` (the scalar decay's `_chunk_scan`, or Kimi's):
    packed documents spread to whole chunks, heads first, padded to a whole chunk; the
    output gathered back to the packed row."""
    dtype = q.dtype
    keep, dest = None, None
    if document_ids is not None and bool(_new_documents(document_ids)[:, 1:].any()):
        dest, padded_len, keep = _document_layout(document_ids, chunk_size)
        q, k, v, g, beta = (_spread(t, dest, padded_len) for t in (q, k, v, g, beta))
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # (B, H, T', ...)
    T = q.shape[2]
    pad = -T % chunk_size  # zero tokens at the end: no decay, no write, outputs dropped
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g = F.pad(g, (0, 0) * (g.dim() - 3) + (0, pad))  # (B, H, T) or (B, H, T, dk)
    beta = F.pad(beta, (0, pad))
    o, S = scan(q, k, v, g, beta, chunk_size, initial_state, keep)  # (B, H, T' + pad, dv)
    o = o[:, :, :T].transpose(1, 2)  # (B, T', H, dv)
    if dest is not None:
        o = o.gather(1, _index_like(dest, o))  # back to the packed row
    return o.to(dtype), (S if output_final_state else None)


def _chunk_scan(q, k, v, g, beta, C: int, S: torch.Tensor | None, keep: torch.Tensor | None):
    """q, k (B, H, T, dk), v (B, H, T, dv), g, beta (B, H, T), T a multiple of C; keep (B, T / C):
    0 where a chunk starts a document. -> o (B, H, T, dv), the final state (B, H, dk, dv)."""
    B, H, T, dk = k.shape
    dv, N = v.shape[-1], T // C
    q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))  # (B, H, N, C, d)
    g, beta = (t.reshape(B, H, N, C) for t in (g, beta))
    gc = g.cumsum(-1)  # log decay from the chunk's start through each position
    # decay[i, j] = exp(gc_i - gc_j) for j <= i; -inf above the diagonal before exp, never inf.
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, N, C, C)
    k_beta = k * beta[..., None]
    # Token i's correction subtracts what the earlier tokens j < i of its chunk already wrote
    # for k_i: the unit lower triangular system (I + A) U = V, A[i, j] = beta_i k_i.k_j decay[i, j].
    # solve_triangular with unitriangular reads only the strictly lower part of `system`.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C) causal, diagonal included
    q_read = q * gc.exp()[..., None]  # reads the state as it stood before the chunk
    k_write = k * (gc[..., -1:] - gc).exp()[..., None]  # decayed to the chunk's end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    S = q.new_zeros(B, H, dk, dv) if S is None else S.to(q.dtype)
    return across_chunks(u, w, q_read, attn, k_write, chunk_decay, S, keep)


def across_chunks(u, w, q_read, attn, k_write, chunk_decay, S: torch.Tensor, keep: torch.Tensor | None):
    """The chunks in order, the state S (B, H, dk, dv) carried between them (zeroed where `keep`
    (B, N) is 0): u, w (B, H, N, C, dv / dk) from the chunk's WY solve, q_read, k_write
    (B, H, N, C, dk), attn (B, H, N, C, C), chunk_decay (B, H, N, 1 or dk, 1). Whatever the
    decay's shape, scalar (Gated DeltaNet) or per key channel (Kimi). -> o (B, H, N C, dv), S."""
    B, H, N, C, dv = u.shape
    # One view per chunk, taken once: indexing the whole tensors inside the loop would give
    # each chunk's backward a gradient the size of the whole sequence (quadratic in T).
    chunks = zip(*(t.unbind(2) for t in (u, w, q_read, attn, k_write, chunk_decay)), strict=True)
    out = []
    for n, (u_n, w_n, q_n, attn_n, k_n, decay_n) in enumerate(chunks):
        if keep is not None and n > 0:
            S = S * keep[:, n].view(B, 1, 1, 1)
        v_new = u_n - w_n @ S  # (B, H, C, dv) what each token writes
        out.append(q_n @ S + attn_n @ v_new)
        S = S * decay_n + k_n.transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).reshape(B, H, N * C, dv), S


def _document_layout(document_ids: torch.Tensor, C: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Each row laid out with its documents padded to whole chunks: dest (B, T), each token's
    place in the padded row; the padded length (a multiple of C); keep (B, padded / C) float,
    0 at the chunks that start a document after the row's first."""
    B, T = document_ids.shape
    starts = _new_documents(document_ids)
    segment = starts.long().cumsum(1) - 1  # (B, T) the document's number within its row
    lengths = torch.zeros(B, int(segment.max()) + 1, dtype=torch.long, device=starts.device)
    lengths.scatter_add_(1, segment, torch.ones_like(segment))
    padded = (lengths + C - 1) // C * C  # (B, n_docs); 0 for the numbers a row does not use
    padded_start = padded.cumsum(1) - padded
    pos = torch.arange(T, device=starts.device).expand(B, T)
    first = torch.where(starts, pos, 0).cummax(1).values  # the first token of each token's document
    dest = padded_start.gather(1, segment) + pos - first
    padded_len = int(padded.sum(1).max())
    keep = torch.ones(B, padded_len // C, device=starts.device)
    rows, cols = starts.nonzero(as_tuple=True)
    keep[rows, dest[rows, cols] // C] = 0.0
    keep[:, 0] = 1.0  # the first document continues the initial state, if any
    return dest, padded_len, keep


def _index_like(dest: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dest (B, T) broadcast to x's trailing dimensions, as a gather/scatter index along dim 1."""
    return dest.view(*dest.shape, *([1] * (x.dim() - 2))).expand(*dest.shape, *x.shape[2:])


def _spread(x: torch.Tensor, dest: torch.Tensor, padded_len: int) -> torch.Tensor:
    """x (B, T, ...) -> (B, padded_len, ...), token t at dest[:, t], zeros between."""
    out = x.new_zeros(x.shape[0], padded_len, *x.shape[2:])
    return out.scatter(1, _index_like(dest, x), x)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule by the fastest form here: flash-linear-attention's chunked kernel
    on CUDA when installed; otherwise the recurrent form for one token (decoding) and the
    chunked reference for more. Arguments and results as `chunk_gated_delta_rule`."""
    fallback = dict(key="gated_deltanet.fla", asked="Gated DeltaNet layers on CUDA",
                    instead="the PyTorch chunked gated delta rule", why="flash-linear-attention (fla) is not installed")
    return fastest(("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), fallback, chunk_gated_delta_rule,
                   q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                   output_final_state=output_final_state, document_ids=document_ids)


def fastest(kernel: tuple[str, str], fallback: dict, chunk_rule, q, k, v, g, beta, *, chunk_size: int,
            **args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A delta rule by the fastest form here: fla's `kernel` (module, name) on CUDA when it
    imports (else the `fallback` is recorded: key, asked, instead, why); the recurrent form for
    one token (decoding), `chunk_rule` for more."""
    if q.is_cuda and q.shape[1] > 1:
        found = optional_kernel(*kernel)
        if found is not None:  # fla's calling convention is the same for both rules
            return fla_gated_delta_rule(found, q, k, v, g, beta, **args)
        fallbacks.record(fallback["key"], asked=fallback["asked"], instead=fallback["instead"], why=fallback["why"],
                         fix="pip install 'forja[fla]' (fla-core, flash-linear-attention's kernels)")
    if q.shape[1] == 1:
        return recurrent_gated_delta_rule(q, k, v, g, beta, **args)
    return chunk_rule(q, k, v, g, beta, chunk_size=chunk_size, **args)


_KERNELS: dict[tuple[str, str], object] = {}  # (module, name) -> the kernel or None, filled on first use


def optional_kernel(module: str, name: str):
    """`module`.`name` (an fla kernel), or None when it is not importable."""
    if (module, name) not in _KERNELS:
        try:
            _KERNELS[module, name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            _KERNELS[module, name] = None
    return _KERNELS[module, name]


def fla_gated_delta_rule(kernel, q, k, v, g, beta, *, initial_state=None, output_final_state=False,
                         document_ids=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's kernel with forja's arguments. Its variable-length form takes one row of
    concatenated documents and their boundaries (cu_seqlens), one state per document."""
    B, T, H, dv = v.shape
    group = H // k.shape[2]
    if group > 1:  # repeated here: not every fla release groups value heads itself
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    cu_seqlens, row_first = None, None
    h0 = initial_state
    if document_ids is not None:
        starts = _new_documents(document_ids).flatten()  # (B * T,)
        first = starts.nonzero().flatten()  # each document's first token in the flat row
        cu_seqlens = torch.cat([first, first.new_tensor([B * T])])
        q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
        row_first = starts.long().cumsum(0)[::T] - 1  # (B,) the number of each row's first document
        if initial_state is not None:
            h0 = initial_state.new_zeros(len(first), *initial_state.shape[1:])
            h0[row_first] = initial_state
    o, S = kernel(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        o = o.reshape(B, T, H, dv)
        if S is not None:  # each row's last document holds its final state
            S = S[torch.cat([row_first[1:], row_first.new_tensor([S.shape[0]])]) - 1]
    return o, S


def gated_delta_rule_flops(n_v_heads: int, head_k_dim: int, head_v_dim: int, seq_len: int, chunk: int = 64) -> int:
    """Training FLOPs per token (3 x forward) of the chunked gated delta rule, beyond the
    projections and convolutions that 6 N counts. Forward, per head and token, within its
    chunk of C: the scores q k^T and (beta k) k^T (2 C dk each) and the scores times the new
    values (2 C dv); the two triangular solves for the WY-transformed values and keys
    (C dv + C dk); across chunks the state read by the queries and the WY keys, and its
    update (2 dk dv each). It grows with C, not with the context: linear attention's point."""
    c = min(chunk, seq_len)
    dk, dv = head_k_dim, head_v_dim
    forward = 2 * c * (2 * dk + dv) + c * (dk + dv) + 3 * 2 * dk * dv
    return 3 * n_v_heads * forward
