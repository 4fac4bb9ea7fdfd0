"""What a DeepSeek-V4 block keeps for backward, per token of the sequence, as forja computes it
(forja/models/deepseek_v4/model.py `HyperConnectedBlock`): two hyper-connections over the
`hc_mult` streams, compressed attention with its scores written out, a scored mixture of
experts with the limited SwiGLU. Counted against the tensors autograd saves, and those op-level
activation checkpointing keeps, by tests/unit/plan/test_v4_activations.py.

Notation (per token): D the width, n the streams, H the query heads of a rank (n_heads / tp), hd
the head width, r the query latent, K the keys a query scores (the row's positions and its
compressed entries: `compressed_keys`, the whole rows' positions written out with a mask), L the
matmuls' bytes (2 under autocast), S the residual stream's (4 unless the parameters are bf16).

- each hyper-connection (hyper_connections.py): the streams' fp32 flatten (the block's input, or
  the streams after attention) and its inverse RMS, the normalized streams its projection reads
  (a cast under autocast), the mixing logits and weights, and every Sinkhorn division's matrix
  and sums (2 iters - 1 of them); its merge keeps the sublayer's output, the expand weights, the
  mixing matrix and, under autocast, the streams' cast;
- norms as every pre-norm keeps them (input, inverse RMS, normalized x), for the block's two, the
  query latent's, the key/value head's and the compressor's (on its entries, 1 / ratio a token);
- attention: the latent's input (one cast per reader under autocast: wq_a, wkv and the
  compressor's two projections), the latent itself, q's fp32 copy for its per-head RMS, the
  score matmul's q and key/value head expanded to the heads, softmax's input and output over the
  K + 1 columns (the sink's), the value matmul's probabilities (a cast under autocast) and its
  own expanded head, the grouped output's per-group input and low-rank output;
- the compressor: its window softmax (fp32) and the weighted values (and the weights' cast);
- the mixture of experts: the router's fp32 input and scores, the routed rows (one cast per
  projection under autocast), five hidden-wide tensors of the limited SwiGLU per slot, the
  product w2 reads, the experts' output, its weighted copy; the shared expert likewise.
The rotary tables (per position, shared by the batch) and integer bookkeeping of a few bytes
are left out. The lightning indexer runs without gradients: it keeps nothing.
"""

from __future__ import annotations

from forja.models.deepseek_v4.model import DeepSeekV4Args
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.saved_parts import FP32, exchanged_rows, routing_picks
from forja.plan.shape import BlockShape


def _hyper_connections(a: DeepSeekV4Args, lin: int, res: int) -> float:
    """Both hyper-connections and their merges, the sublayers' outputs included."""
    n, D = a.hc_mult, a.dim
    autocast = lin != res
    per = n * D * FP32 + FP32 + (n * D * res if res != FP32 else 0)  # the fp32 flatten (a copy of bf16 streams)
    per += n * D * lin  # the normalized streams the projection reads
    per += (2 * n + n * n) * lin + 3 * n * FP32 + n * n * FP32  # mixing logits; pre, post, comb weights
    per += (2 * a.hc_sinkhorn_iters - 1) * (n * n + n) * FP32  # each Sinkhorn division's matrix and sums
    per += n * FP32 + n * n * lin + (n * D * lin if autocast else 0)  # the merge: post, comb, the streams' cast
    return 2 * per + D * lin + D * res  # attention's output (wo_b's dtype), the experts' (the residual's)


def _norm(width: float, in_bytes: int, out_bytes: int) -> float:
    """A pre-norm's input (fp32 inside), inverse RMS and normalized x."""
    return width * in_bytes + FP32 + width * out_bytes


def _compressor_width(a: DeepSeekV4Args, block: BlockShape) -> int:
    """Each compressor projection's output width: two series in CSA's overlap, one in HCA, none in a sliding block."""
    if not a.ratio(block.kind):
        return 0
    return a.head_dim * (2 if block.kind == "compressed_sparse_attention" else 1)


def _attention(job: Job, lay: Layout, block: BlockShape, lin: int, res: int, keys: float) -> float:
    a, t = job.args, lay.tp
    autocast = lin != res
    H, hd, D, r = a.n_heads / t, a.head_dim, a.dim, a.q_lora_rank
    width = _compressor_width(a, block)
    readers = 2 + (2 if width else 0)  # wq_a, wkv (, the compressor's wkv and wgate)
    out = readers * D * lin if autocast else D * res  # the latent's input
    out += _norm(r, FP32, lin) + r * lin + _norm(hd, FP32, lin)  # q_norm and its output (wq_b's input), kv_norm
    out += H * hd * FP32 + H * FP32  # q's per-head RMS: its fp32 copy, inverse RMS
    expanded = H * hd * keys / job.seq_len * lin  # the one key/value head expanded to the heads, per token
    out += H * hd * lin + expanded  # the score matmul's operands
    out += 2 * H * (keys + 1) * FP32 + H * FP32  # softmax's input (with the sink) and output, the row max
    out += expanded + (H * keys * lin if autocast else 0)  # the value matmul's head, the probabilities' cast
    out += H * hd * lin + a.o_groups / t * a.o_lora_rank * lin  # the grouped output's input and low rank
    if width:
        slots = width / hd  # window slots per token: one per ratio, two in CSA's overlap
        out += slots * hd * FP32 + slots * hd * lin * (2 if autocast else 1)  # window softmax, weighted values
        out += _norm(hd, FP32, lin) / a.ratio(block.kind)  # the entries' norm
    return out


def _experts(job: Job, lay: Layout, lin: int, res: int) -> float:
    """The mixture of experts, each rank routing 1 / tp of the tokens."""
    a, t = job.args, lay.tp
    autocast = lin != res
    D, k, W, S, E = a.dim, a.top_k, a.moe_ffn_dim, a.shared_width, a.n_experts
    out = D * FP32 + 2 * E * FP32 + 4 * k + 8 + 3 * 8 * k  # router input, scores; weights, sums, indices
    out += k * (D * (2 * lin if autocast else FP32) + 6 * W * lin + D * lin + FP32 + D * res)  # routed slots
    if S:
        out += (2 * D * lin if autocast else 0) + 6 * S * lin  # the shared expert
    return out / t


def v4_block_saved(job: Job, lay: Layout, block: BlockShape, lin: int, res: int, keys: float) -> tuple[float, float]:
    """(bytes one DeepSeek-V4 block keeps per token without checkpointing, its input streams
    included; of them, what op-level AC keeps: the matmuls' outputs)."""
    a, t = job.args, lay.tp
    sp = 1 / lay.sp_degree  # the streams, their norms and merges: a rank's slice under SP
    n, D, H, hd = a.hc_mult, a.dim, a.n_heads / t, a.head_dim
    full = sp * (_hyper_connections(a, lin, res) + 2 * _norm(D, res, res))
    full += _attention(job, lay, block, lin, res, keys) + _experts(job, lay, lin, res)
    matmuls = sp * 2 * ((2 * n + n * n) + n * D) * lin  # the mixing logits, the merges' comb @ streams
    projections = a.q_lora_rank + H * hd + hd + 2 * _compressor_width(a, block)  # wq_a, wq_b, wkv, compressor
    matmuls += (projections + H * keys + H * hd + a.o_groups / t * a.o_lora_rank + D) * lin  # scores .. wo_b
    k, W, S = a.top_k, a.moe_ffn_dim, a.shared_width
    matmuls += (a.n_experts * FP32 + (k * (2 * W + D) + (2 * S + D if S else 0)) * lin) / t
    matmuls += (routing_picks(a) + exchanged_rows(lay, k, D, lin)) / t  # the router's picks, the exchanges
    return full, matmuls
