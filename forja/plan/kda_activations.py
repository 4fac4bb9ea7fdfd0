"""What a Kimi Delta Attention (KDA) mixer keeps for backward, per token, as forja computes it
(forja/models/common/kimi_delta_attention.py and kimi_delta_rule.py, over Gated DeltaNet's
convolutions and `across_chunks`), and of it what op-level selective activation checkpointing
keeps (the matmuls' outputs). Its pre-norm is counted as every block's (activations.py
`norm_saved`, six readers: wq, wk, wv, wb, wf_a, wg_a). Counted against the tensors autograd
saves by tests/unit/plan/test_kda_activations.py.

Gated DeltaNet's count (activations.py `linear_attention_saved`) does not fit KDA: its decay is a
vector over each head's key channels, so the chunked rule's intra-chunk scores are contracted
through a (C, C, d) tensor of decays, which torch.einsum copies again into its batched matmul's
layout for each of the two scores (three C-by-d-wide tensors per token and head, most of the
block at the reference's chunk of 16, with the state kept at every chunk's start, d^2 / C a
token); the decay and the output gate come from low-rank projections, the gate a sigmoid in fp32.
Under autocast the reference's triangular solves meet a bf16 system, which torch has no kernel
for (CPU or CUDA): that count is what fake tensors run (forja's rehearsal), unmeasurable on a
device until the rule solves in fp32; on CUDA with fla installed its kernel runs instead.

Notation (per token of a rank): H the rank's heads (linear_n_heads / tp), d a head's width (keys
and values alike, and the rank of the low-rank projections), W = H d, T the tokens the rule
scans (a rank's shard under ring CP), C the reference's chunk, n = ceil(T / C) chunks, r = n C / T
(the rule pads to whole chunks: its tensors hold r tokens per token), L the matmuls' bytes (2
under autocast, else 4). The rotary-free block has no per-position tables; a few bytes of masks
are left out.
"""

from __future__ import annotations

import math

from forja.plan.context_parallel import mixer_length
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.shape import BlockShape

FP32 = 4
FLA_CHUNK = 64
"""The chunk of fla's `chunk_kda` kernel (its (T, chunk) score matrices), whatever forja's reference uses."""


def _gates(H: int | float, d: int, taps: int, T: float, lin: int) -> float:
    """The projections' small outputs, the decay and the convolutions, per token."""
    W = H * d
    low_rank = 2 * d * lin  # wf_a's and wg_a's outputs, wf_b's and wg_b's input (whole on every TP rank)
    beta = H * lin  # sigmoid(x W_b), as the rule's product reads it
    # The decay in fp32: softplus written as where(f > 20, f, log(1 + exp(f))) keeps exp(f),
    # 1 + exp(f) and the condition (a byte); -exp(A_log) times it keeps softplus.
    decay = W * (3 * FP32 + 1)
    conv = (2 + (taps - 1) / T) * 3 * W * lin  # each convolution's input (its window too) and SiLU's input
    return low_rank + beta + decay + conv


def _reference_rule(d: int, C: int, T: float, lin: int) -> float:
    """Bytes per token and head of the PyTorch chunked rule (`_chunk_scan`, `across_chunks`),
    all fp32 inside; under autocast its matmuls keep bf16 casts of their operands instead."""
    n = math.ceil(T / C)
    r = n * C / T
    autocast = lin != FP32
    # The last chunk's state update, which nothing reads, frees what only it saved once the
    # forward returns: in one chunk k decayed to the chunk's end, that decay and the chunk's.
    writes = n > 1
    norms = (2 * d + 2) * FP32  # q and k into their L2 norms (fp32, before padding) and the inverse norms
    # fp32 whatever the autocast: the (C, C, d) decays exp(gc_i - gc_j); k, k beta, v (padded), q
    # (normalized, scaled), the two exp(gc) (w's right side, q_read's), beta; the decay to the
    # chunk's end and each chunk's whole decay (d a chunk).
    kept32 = C * d + 6 * d + 1 + writes * (d + d / C)
    # The two einsums (k beta and q against k through the decays): each copies its (C, C, d)
    # operand into the batched matmul's layout, and k too: a bf16 cast under autocast, in fp32 a
    # copy where no padding made k contiguous (F.pad by nothing keeps the heads-first strides);
    # their (C, C) outputs, the system the solves keep and attn; the solves' outputs u and w;
    # each chunk's new values v_new.
    operands = 2 * C * d + (2 * d if autocast or T % C == 0 else 0) + 2 * C + 2 * d + d
    # q_read and k_write as the per-chunk matmuls read them: in fp32 the tensors themselves where
    # any chunk keeps them (the first chunk's read of the zero state, and the last update, keep
    # neither); under autocast one bf16 cast a chunk, n - 1 of them.
    read_write = 2 * d * ((n - 1) / n * lin if autocast else writes * FP32)
    if autocast:  # each chunk's incoming state cast twice (w S, q S); fp32 as S * decay keeps it but the last
        states = (2 * n * lin + (n - 1) * FP32) * d * d / T
    else:  # the state at each chunk's start, as w S keeps it
        states = n * d * d * FP32 / T
    return norms + r * (kept32 * FP32 + operands * lin + read_write) + states


def _fla_rule(d: int, lin: int) -> float:
    """Bytes per token and head fla's `chunk_kda` keeps (from fla's source, not measured here):
    the L2-normalized q and k, v, their inverse norms, the per-chunk cumulative decay and the
    decay it was given (fp32), its (T, chunk) q k scores and the (T, chunk) WY matrix (fp32)."""
    return 3 * d * lin + 2 * FP32 + 2 * d * FP32 + FLA_CHUNK * (lin + FP32)


def kda_saved(job: Job, lay: Layout, block: BlockShape, lin: int) -> tuple[float, float]:
    """(bytes per token a KDA mixer keeps beyond its pre-norm without checkpointing, bytes of its
    matmuls' outputs, which op-level AC keeps), on a rank: its heads split over TP."""
    n_heads, _, d, _, taps, C = block.mixer  # as many key as value heads, one width
    H, T = n_heads / lay.tp, mixer_length(job, lay)
    W = H * d
    fla = job.gpu and job.fla
    rule = H * (_fla_rule(d, lin) if fla else _reference_rule(d, C, T, lin))
    # The gated output norm, in fp32: the rule's output as it reads it (in fp32 the padded
    # output itself, else its fp32 copy), the inverse RMS, the normalized output, weight times
    # it and sigmoid(gate); the result cast back, wo's input.
    padded = math.ceil(T / C) * C / T if lin == FP32 and not fla else 1.0
    out = W * (padded + 3) * FP32 + H * FP32 + W * lin
    # Op-level AC: wq, wk, wv, wf_b, wg_b (W each), wb, wf_a and wg_a, wo (the model's width);
    # the reference's batched matmuls too (fla's kernel runs none): the two einsums' (C, C)
    # outputs, w S, q S and attn v_new (d each), k^T v_new (a state a chunk, the last too).
    matmuls = (5 * W + H + 2 * d + job.args.dim) * lin
    if not fla:
        n = math.ceil(T / C)
        matmuls += H * (n * C / T * (2 * C + 3 * d) + n * d * d / T) * lin
    return _gates(H, d, taps, T, lin) + rule + out, matmuls
