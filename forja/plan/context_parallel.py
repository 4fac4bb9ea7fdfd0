"""What context parallelism moves and holds, per block and micro-batch, for each kind
(`parallel.cp_kind`): the volumes the speed model puts on the cp link and the transient
buffers the memory model adds. Formulas in docs/planner.md ("CP").

- ring: each rank's K and V (B, Hkv/tp, T/cp, hd each) travel the ring, cp - 1 hops forward;
  backward passes K, V again and their gradient accumulators dK, dV (one hop more, back to
  their owners). Its blocks are fp32 PyTorch matmuls over materialized scores (below). The
  recurrent mixers scan across the shards instead: an all-gather of each rank's state
  transition and state in fp32 (Gated DeltaNet, Kimi Delta Attention: (B, Hv/tp, dk, dk + dv);
  Mamba-2: (B, H/tp, P N + 1)) and the convolutions' halos.
- all-to-all (Ulysses): q, k, v (B, T/cp, H/tp hd) re-sharded over heads to (B, T, H/(tp cp) hd)
  and the output back, one all-to-all each; the same four in backward. KV heads fewer than
  cp are replicated, one per rank, so the k and v all-to-alls carry cp / Hkv times more. A
  recurrent mixer moves its projections (Mamba-2's groups of B and C replicated as KV heads
  are) and its output.
MLP and MoE blocks (Nemotron-H's) mix no sequence: nothing moves.
DeepSeek-V4's blocks, under either kind, keep their queries: they all-gather each chunk's
window of the one key/value head and its compressors' lead-in, and the whole rows' compressed
entries (forja/parallel/cp/compressed.py), the gradients summed back.
A DeepSeek Sparse Attention block moves latent attention's tensors and, for its indexer, the
whole rows' indexer keys (an all-gather; their gradient summed back when trained); all-to-all
also gathers the whole rows' selection (a byte a query and key). Trained, its target moves:
all-to-all sends the head sums of the whole rows' probabilities (fp32) to the queries' ranks,
ring takes K round once more (forja/parallel/cp/__init__.py `attend_selected`).
"""

from __future__ import annotations

from forja.models.common.compressed_attention import V4_LAYER_TYPES
from forja.models.common.kimi_delta_attention import KimiDeltaArgs
from forja.models.common.mla import LatentAttentionArgs
from forja.models.deepseek_v4.model import DeepSeekV4Args
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.shape import BlockShape

FP32 = 4
# forja's ring (forja/parallel/cp/ring.py) computes each block of T/(2cp) queries by T/(2cp)
# keys with PyTorch's fp32 matmuls, its scores materialized (no fused kernel yet: the fallback
# record says "cp.ring"): q, k, v are upcast first, so K, V and their gradients travel in fp32,
# and every op on a block's scores streams them through memory. Fp32 reads and writes of each
# computed score, counted from ring.py's ops: forward 10 (the scores written, scaled, the
# log-sum-exp's read, s - lse, exp, p read by p @ v), backward 16 (the scores, s - lse and exp
# again, p read by dV's einsum, dO V^T written, minus D, times p, ds read by dQ's and dK's).
RING_KV_BYTES = FP32
RING_GRAD_BYTES = FP32
RING_SCORE_PASSES = (10, 16)
# FLOPs per score and head dimension: q k^T and p v forward (4); backward recomputes q k^T and
# makes dV, dO V^T, dQ and dK (10).
RING_SCORE_FLOPS = (4, 10)
# Score-sized fp32 temporaries alive at once in a block's backward (p, dO V^T, ds).
RING_SCORE_TEMPS = 3
# Blocks whose mixer scans across the shards under ring; blocks with no sequence mixer.
SCANNED = ("linear_attention", "mamba2")
NO_MIXER = ("mlp", "moe")


def act_bytes(job: Job) -> int:
    """Bytes of one element of q, k, v and the attention output (the matmuls' dtype)."""
    return 2 if job.bf16 else FP32


def replicas(heads: float, cp: int) -> float:
    """How much larger a tensor of `heads` heads (per TP rank) grows in an all-to-all over cp
    ranks: heads fewer than cp are replicated, one per rank."""
    return cp / heads if 0 < heads < cp else 1.0


def attention_widths(job: Job, lay: Layout) -> tuple[float, float, float, float]:
    """Elements per token of q, k, v and the output on one TP rank (latent attention expands
    its keys and values to every head)."""
    a, t = job.args, lay.tp
    q = a.n_heads * a.head_dim / t
    if isinstance(a, LatentAttentionArgs):
        return q, q, a.n_heads * a.v_head_dim / t, a.n_heads * a.v_head_dim / t
    kv = a.n_kv_heads * a.head_dim / t
    return q, kv, kv, q


def a2a_elements(job: Job, lay: Layout, block: BlockShape) -> float:
    """Elements per token the four forward all-to-alls of one block carry: q, k, v in and the
    output back (k and v replicated where the KV heads are fewer than cp); a recurrent mixer's
    projections in and output back."""
    if block.kind in NO_MIXER:
        return 0.0
    if block.kind == "mamba2":  # x, B, C and dt in (B, C replicated where the groups are fewer than cp); y out
        H, P, G, N, _, _ = block.mamba2
        return (2 * H * P + H + 2 * G * N * replicas(G / lay.tp, lay.cp)) / lay.tp
    if block.kind == "linear_attention":
        n_k, n_v, dk, dv, _, _ = block.mixer
        decay = n_v * dk if isinstance(job.args, KimiDeltaArgs) else 0  # KDA's decay is per key channel
        return (2 * n_k * dk + 2 * n_v * dv + decay) / lay.tp  # q, k, v in; out (beta, a value per head, left out)
    q, k, v, out = attention_widths(job, lay)
    rep = 1.0 if isinstance(job.args, LatentAttentionArgs) else replicas(job.args.n_kv_heads / lay.tp, lay.cp)
    return q + (k + v) * rep + out


def ring_kv_bytes(job: Job, lay: Layout, tokens_mb: float) -> tuple[float, float]:
    """(bytes of this rank's K and V, of their gradients dK and dV) in one attention block, as
    the ring passes them (fp32)."""
    _, k, v, _ = attention_widths(job, lay)
    return tokens_mb * (k + v) * RING_KV_BYTES, tokens_mb * (k + v) * RING_GRAD_BYTES


def ring_scores(job: Job, lay: Layout) -> float:
    """Scores one rank computes per sequence, head (of its TP share) and pass of an attention
    block under ring: of the 2cp x 2cp blocks of T/(2cp) chunks, the 2cp + 1 that causal order
    leaves a rank of its chunk and mirror (a window or documents skip more; not counted)."""
    c = job.seq_len / (2 * lay.cp)
    return (2 * lay.cp + 1) * c * c * job.args.n_heads / lay.tp


def ring_attention_work(job: Job, lay: Layout, sequences: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward FLOPs, backward FLOPs), (forward bytes, backward bytes)) of one attention
    block's ring blocks on one rank per micro-batch: fp32 matmuls and score passes."""
    scores = sequences * ring_scores(job, lay)
    flops = tuple(f * scores * job.args.head_dim for f in RING_SCORE_FLOPS)
    traffic = tuple(n * scores * FP32 for n in RING_SCORE_PASSES)
    return flops, traffic


def ring_scan_bytes(job: Job, lay: Layout, block: BlockShape, sequences: float) -> tuple[float, float]:
    """(bytes of one rank's state transition, of its convolution halo) in a recurrent block
    under ring: the transition and state in fp32, all-gathered over the cp ranks (a delta
    rule's (B, Hv/tp, dk, dk + dv), Mamba-2's (B, H/tp, P N + 1)); the last taps - 1 tokens of
    the convolutions' inputs (q, k, v or x, B, C) sent to the next rank."""
    if block.kind == "mamba2":
        H, P, G, N, taps, _ = block.mamba2
        state = sequences * H / lay.tp * (P * N + 1) * FP32
        return state, sequences * (taps - 1) * (H * P + 2 * G * N) / lay.tp * act_bytes(job)
    n_k, n_v, dk, dv, taps, _ = block.mixer
    state = sequences * n_v / lay.tp * dk * (dk + dv) * FP32
    halo = sequences * (taps - 1) * (2 * n_k * dk + n_v * dv) / lay.tp * act_bytes(job)
    return state, halo


def cp_buffers(job: Job, lay: Layout, block: BlockShape, tokens_mb: float) -> float:
    """Transient bytes one block's context parallelism holds while it computes, beyond what
    autograd keeps: ring's two receive buffers of K, V and, in backward, of dK, dV (or a
    recurrent mixer's gathered transitions); all-to-all's other form of q, k, v and the output
    (the local (B, T/cp, H/tp) one or the full-sequence (B, T, H/(tp cp)) one, the same size);
    a DeepSeek-V4 block's gathered halos and entries."""
    if lay.cp == 1 or block.kind in NO_MIXER:
        return 0.0
    if compressed_block(job, block):  # DeepSeek-V4: the gathered halos and entries
        return compressed_gathers(job, lay, block, tokens_mb)[0]
    if lay.cp_kind == "all-to-all":
        return tokens_mb * a2a_elements(job, lay, block) * act_bytes(job) + indexer_buffers(job, lay, block, tokens_mb)
    if block.kind in SCANNED:
        sequences = lay.sequences_per_microbatch(job.global_batch_size)
        return lay.cp * ring_scan_bytes(job, lay, block, sequences)[0]
    # Backward holds the most: fp32 copies of q, k, v, dO (under autocast), dQ, this rank's and
    # the incoming dK, dV, the next K, V, and one block's score-sized temporaries.
    q, k, v, out = attention_widths(job, lay)
    copies = (q + k + v + out) if act_bytes(job) != FP32 else 0.0
    per_token = (copies + q + 3 * (k + v)) * FP32
    sequences = lay.sequences_per_microbatch(job.global_batch_size)
    c = job.seq_len / (2 * lay.cp)
    temps = RING_SCORE_TEMPS * sequences * job.args.n_heads / lay.tp * c * c * FP32
    return tokens_mb * per_token + temps + indexer_buffers(job, lay, block, tokens_mb)


def indexer_gathers(job: Job, lay: Layout, block: BlockShape, tokens_mb: float) -> tuple[float, float]:
    """(bytes a DeepSeek Sparse Attention block all-gathers over cp per micro-batch, the whole
    gathered tensors; bytes it all-reduces in backward): the whole rows' indexer keys, and their
    gradient where the indexer trains; under all-to-all the whole rows' selection too (uint8),
    where the rows are longer than top-k (not in the dense warm-up) or the target needs it."""
    if lay.cp == 1 or not block.indexer:
        return 0.0, 0.0
    _, width, topk, stage = block.indexer
    whole = tokens_mb * lay.cp  # the rows' tokens
    gathered = whole * width * act_bytes(job)
    if lay.cp_kind == "all-to-all" and (stage or job.seq_len > topk):
        gathered += whole * job.seq_len
    return gathered, whole * width * act_bytes(job) if stage else 0.0


def indexer_target_bytes(job: Job, lay: Layout, block: BlockShape, tokens_mb: float) -> float:
    """Bytes per micro-batch a trained indexer's target moves from one rank, forward only:
    all-to-all's head sums of the whole rows' probabilities (B, T, T) fp32, each query's row to
    its rank; ring's K (fp32) taken round again, cp - 1 hops."""
    if lay.cp == 1 or not block.indexer or not block.indexer[3]:
        return 0.0
    if lay.cp_kind == "all-to-all":
        return tokens_mb * lay.cp * job.seq_len * FP32
    return (lay.cp - 1) * tokens_mb * attention_widths(job, lay)[1] * FP32


def indexer_buffers(job: Job, lay: Layout, block: BlockShape, tokens_mb: float) -> float:
    """Transient bytes a DeepSeek Sparse Attention block's CP adds: the whole rows' indexer keys;
    under all-to-all the whole rows' selection (a byte a query and key) and, trained, this
    rank's heads' probability sums over the whole rows with the two copies their exchange makes
    (fp32); under ring, trained, the target of this rank's queries (fp32)."""
    if not block.indexer:
        return 0.0
    _, width, _, stage = block.indexer
    held = tokens_mb * lay.cp * width * act_bytes(job)
    if lay.cp_kind == "all-to-all":
        return held + tokens_mb * lay.cp * job.seq_len * (1 + (3 * FP32 if stage else 0))
    return held + (tokens_mb * job.seq_len * FP32 if stage else 0.0)


def cp_saved_extra(job: Job, lay: Layout) -> float:
    """Bytes per token an attention block keeps under CP beyond SDPA's count (whose output is
    the tensor wo keeps): ring's own fp32 output, or all-to-all's output in its full-sequence
    form (wo keeps the copy that comes back)."""
    if lay.cp == 1:
        return 0.0
    return attention_widths(job, lay)[3] * (FP32 if lay.cp_kind == "ring" else act_bytes(job))


def mixer_length(job: Job, lay: Layout) -> float:
    """Tokens of each sequence a rank's sequence mixer runs over: its T/cp shard under ring,
    the whole sequence (for its share of the heads) under all-to-all."""
    return job.seq_len / lay.cp if lay.cp > 1 and lay.cp_kind == "ring" else float(job.seq_len)


def compressed_block(job: Job, block: BlockShape) -> bool:
    """A DeepSeek-V4 block: under either kind its compressed attention keeps the rank's queries
    and gathers what its chunks need (forja/parallel/cp/compressed.py), not q, k, v's exchange."""
    return isinstance(job.args, DeepSeekV4Args) and block.kind in V4_LAYER_TYPES


def _chunks(job: Job, lay: Layout) -> tuple[int, float]:
    """(chunks of a row, tokens a chunk) under the layout's kind."""
    n = 2 * lay.cp if lay.cp_kind == "ring" else lay.cp
    return n, job.seq_len / n


def compressed_keys(job: Job, lay: Layout, block: BlockShape) -> float:
    """Keys a query's scores span in a DeepSeek-V4 block as forja computes them (fp32, written
    out): the row's T (the window a mask over them) and its T / ratio compressed entries; under
    CP the window's reach before its chunk, the chunk and the entries."""
    a = job.args
    entries = job.seq_len // a.ratio(block.kind) if a.ratio(block.kind) else 0
    if lay.cp == 1:
        return float(job.seq_len + entries)
    _, c = _chunks(job, lay)
    reach = job.seq_len - c if a.sliding_window is None else min(a.sliding_window - 1, job.seq_len - c)
    return reach + c + entries


def compressed_gathers(job: Job, lay: Layout, block: BlockShape, tokens_mb: float) -> tuple[float, float]:
    """(bytes a DeepSeek-V4 block all-gathers over cp per micro-batch, the whole gathered tensors;
    bytes whose gradient it all-reduces in backward): every chunk's last window - 1 positions of
    the key/value head; every chunk's last ratio - 1 positions (2 ratio - 1 for CSA) of each
    compressor's projections (values and gates); the whole rows' entries. The indexer's keys
    pass no gradient."""
    if lay.cp == 1 or not compressed_block(job, block):
        return 0.0, 0.0
    a, sequences = job.args, tokens_mb * lay.cp / job.seq_len
    n, c = _chunks(job, lay)
    reach = job.seq_len - c if a.sliding_window is None else min(a.sliding_window - 1, job.seq_len - c)
    summed = n * min(reach, c) * a.head_dim  # elements a row
    gathered, m = summed, a.ratio(block.kind)
    if m:
        csa = block.kind == "compressed_sparse_attention"
        lead = min(m - 1 + (m if csa else 0), c)
        compressor = n * lead * 2 * (2 if csa else 1) * a.head_dim + job.seq_len / m * a.head_dim
        summed += compressor
        gathered += compressor + (n * lead * 4 * a.index_head_dim + job.seq_len / m * a.index_head_dim if csa else 0)
    return sequences * gathered * act_bytes(job), sequences * summed * act_bytes(job)
