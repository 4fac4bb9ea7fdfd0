"""The Mamba-2 selective state-space scan (Dao & Gu 2024, "Transformers are SSMs: Generalized
Models and Efficient Algorithms Through Structured State Space Duality", arXiv 2405.21060),
as pure functions on tensors: a step-by-step recurrence, the chunked state-space-duality
(SSD) form, and a dispatch to the `mamba_ssm` kernel on CUDA.

Per head h (a scalar decay A_h < 0 and a time step dt_t > 0 per token), a state S (P, N):

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T        x_t (P,), B_t (N,)
    y_t = S_t C_t                                       C_t (N,)

B and C are shared by the H / G heads of each of G groups. `D x_t` (the skip) and the gate
are the mixer's (forja/models/common/mamba2.py), not the scan's.

The chunked form (SSD) splits the sequence into chunks of C tokens: inside a chunk the
outputs are a masked "attention" (C_i . B_j) exp(a_i - a_j) dt_j x_j over j <= i with a the
running sum of dt A; across chunks one state per chunk carries the rest, so the sequential
part is T / C steps of (P, N) updates.

Packed documents (`document_ids` (B, T)): the state does not flow from one document into the
next. Every decay that would cross a document start is multiplied by zero: inside a chunk
between tokens of different documents; from the chunk's incoming state to the tokens after a
start in the chunk; from the chunk's tokens to its outgoing state when a later document starts
in it; and the incoming state itself to the outgoing one. With an `initial_state` the row's
first document continues from it (a document carried on from a cache).

All math runs in float32, or float64 for float64 inputs (where the checks hold it to 1e-10).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forja import fallbacks


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _segments(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) long: each token's document number within its row, 0 for the row's first."""
    starts = torch.zeros_like(document_ids, dtype=torch.long)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    return starts.cumsum(1)


def _to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, G, N) -> (B, T, H, N): each group's B or C repeated to its H / G consecutive heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2) if t.shape[2] != heads else t


def recurrent_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                   initial_state: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan one token at a time. x (B, T, H, P); dt (B, T, H), the time steps after
    softplus and clamping; A (H,) negative; B, C (B, T, G, N); initial_state (B, H, P, N)
    -> y (B, T, H, P) and the final state (B, H, P, N), both in the compute dtype."""
    dtype = _compute_dtype(x)
    b, T, H, P = x.shape
    x, dt, A = x.to(dtype), dt.to(dtype), A.to(dtype)
    B, C = _to_heads(B, H).to(dtype), _to_heads(C, H).to(dtype)
    S = x.new_zeros(b, H, P, B.shape[-1]) if initial_state is None else initial_state.to(dtype)
    seg = _segments(document_ids) if document_ids is not None else None
    out = []
    for t in range(T):
        if seg is not None and t > 0:
            S = S * (seg[:, t] == seg[:, t - 1]).to(dtype).view(b, 1, 1, 1)  # a new document starts from zero
        decay = torch.exp(dt[:, t] * A)  # (b, H)
        S = S * decay[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", S, C[:, t]))
    y = torch.stack(out, dim=1) if out else x.new_zeros(b, 0, H, P)  # (b, T, H, P)
    return y, S


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
               chunk_size: int = 128, initial_state: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan a chunk of `chunk_size` tokens at a time (SSD); the same arguments and results
    as `recurrent_scan`. T need not be a multiple of chunk_size: padding tokens have dt = 0,
    so they neither decay nor write the state."""
    dtype = _compute_dtype(x)
    b, T, H, P = x.shape
    L = chunk_size
    pad = -T % L
    B, C = _to_heads(B, H).to(dtype), _to_heads(C, H).to(dtype)
    xdt = x.to(dtype) * dt.to(dtype)[..., None]  # (b, T, H, P) the input as written
    a = dt.to(dtype) * A.to(dtype)  # (b, T, H) log decay per token
    xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, B, C))
    a = F.pad(a, (0, 0, 0, pad))
    n = (T + pad) // L
    xdt, B, C = (t.reshape(b, n, L, H, -1) for t in (xdt, B, C))  # (b, n, L, H, *)
    acs = a.reshape(b, n, L, H).permute(0, 3, 1, 2).cumsum(-1)  # (b, H, n, L) decay from the chunk's start
    upper = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)
    decay = (acs[..., :, None] - acs[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (b, H, n, L, L)
    to_end = (acs[..., -1:] - acs).exp()  # (b, H, n, L) from each token to the chunk's end
    from_start = acs.exp()  # (b, H, n, L) from the chunk's start to each token
    carry = acs[..., -1].exp()  # (b, H, n) across the whole chunk
    if document_ids is not None:
        decay, to_end, from_start, carry = _cut_at_documents(document_ids, pad, L, decay, to_end, from_start, carry)
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay  # (b, H, n, L, L)
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)  # within each chunk
    B_end = B * to_end.permute(0, 2, 3, 1)[..., None]  # (b, n, L, H, N)
    states = torch.einsum("bclhn,bclhp->bchpn", B_end, xdt)  # (b, n, H, P, N) each chunk's own writes
    S = x.new_zeros(b, H, P, B.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    # One view per chunk, taken once (indexing whole tensors inside the loop would give each
    # chunk's backward a gradient the size of the whole sequence).
    C_read = C * from_start.permute(0, 2, 3, 1)[..., None]  # (b, n, L, H, N)
    off = []
    for C_c, states_c, carry_c in zip(C_read.unbind(1), states.unbind(1), carry.unbind(2), strict=True):
        off.append(torch.einsum("blhn,bhpn->blhp", C_c, S))  # what the incoming state gives
        S = S * carry_c[..., None, None] + states_c
    y = (y + torch.stack(off, dim=1)).reshape(b, n * L, H, P)[:, :T]
    return y, S


def _cut_at_documents(document_ids: torch.Tensor, pad: int, L: int, decay, to_end, from_start, carry):
    """The chunked scan's decays with every path across a document start zeroed."""
    seg = F.pad(_segments(document_ids), (0, pad), mode="replicate")  # (b, n L) padding joins the last
    b = seg.shape[0]
    seg = seg.view(b, 1, -1, L)  # (b, 1, n, L)
    # The document of the token before each chunk (the row's first: 0, the initial state's).
    before = F.pad(seg[..., -1], (1, 0))[..., :-1]  # (b, 1, n)
    last = seg[..., -1]  # (b, 1, n)
    dtype = decay.dtype
    decay = decay * (seg[..., :, None] == seg[..., None, :]).to(dtype)
    to_end = to_end * (seg == last[..., None]).to(dtype)
    from_start = from_start * (seg == before[..., None]).to(dtype)
    carry = carry * (last == before).to(dtype)
    return decay, to_end, from_start, carry


def state_reach(dt: torch.Tensor, A: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, H) in the compute dtype: how much of an initial state each token's state still
    holds, exp(dt_1 A + ... + dt_t A), zero from the row's second document on. The scan is
    affine in its initial state S0: a token's state is its state from zero plus this times S0,
    and its output that plus `read_state`'s."""
    dtype = _compute_dtype(dt)
    reach = (dt.to(dtype) * A.to(dtype)).cumsum(1).exp()  # (B, T, H) each term <= 0: no overflow
    if document_ids is not None:
        reach = reach * (_segments(document_ids) == 0).to(dtype)[..., None]
    return reach


def read_state(C: torch.Tensor, reach: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """What an initial state (B, H, P, N) adds to the outputs of tokens that still hold `reach`
    (B, T, H) of it, read through C (B, T, G, N) -> (B, T, H, P) in reach's dtype."""
    C = _to_heads(C, reach.shape[-1]).to(reach.dtype)
    return torch.einsum("bthn,bhpn->bthp", C, state.to(reach.dtype)) * reach[..., None]


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                chunk_size: int = 128, initial_state: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan by the fastest form here: `mamba_ssm`'s chunked kernel on CUDA when installed;
    otherwise the recurrence for one token (decoding) and the chunked form for more. Arguments
    and results as `chunk_scan`."""
    if x.is_cuda and x.shape[1] > 1 and x.dtype != torch.float64:
        kernel = _mamba_ssm_kernel()
        if kernel is not None and (document_ids is None or initial_state is None):
            return _kernel_scan(kernel, x, dt, A, B, C, chunk_size, initial_state, document_ids)
        if kernel is None:
            fallbacks.record("mamba2.mamba_ssm", asked="Mamba-2 layers on CUDA",
                             instead="the PyTorch chunked Mamba-2 scan",
                             why="mamba_ssm (the state-spaces kernels) is not installed",
                             fix="pip install mamba-ssm causal-conv1d")
    if x.shape[1] == 1:
        return recurrent_scan(x, dt, A, B, C, initial_state=initial_state, document_ids=document_ids)
    return chunk_scan(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state, document_ids=document_ids)


_KERNELS: dict[str, object] = {}  # name -> the kernel or None, filled on first use


def _mamba_ssm_kernel():
    """mamba_ssm's `mamba_chunk_scan_combined`, or None when the package is not importable."""
    if "scan" not in _KERNELS:
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as kernel
        except ImportError:
            kernel = None
        _KERNELS["scan"] = kernel
    return _KERNELS["scan"]


def _kernel_scan(kernel, x, dt, A, B, C, chunk_size, initial_state, document_ids):
    """mamba_ssm's kernel with forja's arguments: the time steps already softplus'd and clamped
    (no bias, no softplus inside), no D or gate (the mixer's), documents as its seq_idx."""
    seq_idx = _segments(document_ids).to(torch.int32) if document_ids is not None else None
    y, S = kernel(x, dt, A.float(), B, C, chunk_size, initial_states=initial_state, seq_idx=seq_idx,
                  return_final_states=True)
    return y, S.float()


def causal_conv1d_kernel():
    """causal_conv1d's `causal_conv1d_fn` (the depthwise convolution with SiLU), or None."""
    if "conv" not in _KERNELS:
        try:
            from causal_conv1d import causal_conv1d_fn as kernel
        except ImportError:
            kernel = None
        _KERNELS["conv"] = kernel
    return _KERNELS["conv"]


def mamba2_scan_flops(n_heads: int, head_dim: int, state_size: int, seq_len: int, chunk: int = 128) -> int:
    """Training FLOPs per token (3 x forward) of the chunked scan, beyond the projections and
    convolution that 6 N counts. Forward, per head and token, within its chunk of C: the
    scores C_i . B_j (2 C N) and the scores times the inputs (2 C P); across chunks the chunk's
    state written from its tokens and read by them (2 P N each). Linear in the context."""
    c = min(chunk, seq_len)
    forward = 2 * c * (state_size + head_dim) + 4 * head_dim * state_size
    return 3 * n_heads * forward
