"""What a Gemma 4 block keeps for backward, per token, as forja computes it
(forja/models/gemma4/attention.py `Gemma4Block`, moe.py `Gemma4MoE`), each block by its own
shapes (`BlockShape.gemma4`) rather than the model's: a global block's wider heads (512 against
256) and its own key/value heads, a shared key/value block that projects no keys or values and
attends over its producer's (kept by the producer already), a double-wide GeGLU, a dense GeGLU
beside the experts, and the per-layer input. Counted against the tensors autograd saves and
those op-level activation checkpointing keeps by tests/unit/plan/test_gemma4_activations.py.

Notation (per token of the rank): D the width, L the matmuls' bytes (2 under autocast), S the
residual stream's (4 unless the parameters are bf16), 4 for fp32 whatever the others.

- attention: the pre-norm and its input copies (wq, and wk, wv where the block projects them);
  the per-head q, k norms' fp32 input and normalized output (and one inverse RMS a head); the
  weightless value norm's fp32 input (wv's own output in fp32, a copy under autocast; with
  values = keys in fp32, the raw keys the key norm keeps already); attention's q, k, v, output
  and log-sum-exp (a shared block's k and v are its producer's tensors, but under autocast it
  makes its own bf16 cast of the keys, fp32 from the key norm's fp32 weight); the post-norm on
  wo's output;
- the dense GeGLU: gelu's input and output, up and their product (4 F), its norms;
- the mixture beside it (26B-A4B; each rank routes 1/tp of the tokens): the router's normalized
  input (S) and its gate's fp32 input, the softmax's fp32 scores, the routing's indices and
  weights (top-k, their sum, before and after the per-expert scales, the sort order, each slot's
  token and weight); the experts' norm (S); per slot the rows as w1 and w3 read them (one cast
  each under autocast), the GeGLU's 4 hidden-wide tensors, the output and it times the fp32
  weight (fp32, index_add's source). The two output norms read fp32 where the experts' sum, in
  the stream's dtype, joins: normalized x in S, not L;
- the per-layer input: ple_gate's input (its cast under autocast), gelu's input and output and
  ple_proj's input (P each), ple_norm on ple_proj's output.
The block-wide norms' inverse RMS (4 bytes each) and the rotary tables are left out, as for
every family (forja/plan/activations.py).
"""

from __future__ import annotations

from forja.plan import saved_parts as base
from forja.plan.context_parallel import cp_saved_extra, replicas
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.shape import BlockShape

FP32 = 4


def gemma4_attention_saved(job: Job, lay: Layout, block: BlockShape, w: base.Widths) -> tuple[float, float]:
    """(saved bytes per token of a Gemma 4 block's attention half, of which op-level AC keeps:
    the projections' outputs, attention's output and log-sum-exp)."""
    H, kv_heads, hd, k_eq_v, _, _ = block.gemma4
    t, lin = lay.tp, w.lin
    hq, hkv, heads = H * hd / t, kv_heads * hd / t, H / t
    readers = 1 + (0 if not kv_heads else 1 if k_eq_v else 2)  # wq (, wk (, wv))
    q_norm = (FP32 + lin) * hq + heads * FP32  # wq's output upcast, normalized q; an inverse RMS a head
    kv = 0.0
    if kv_heads:
        rep = replicas(kv_heads / t, lay.cp) if lay.cp > 1 and lay.cp_kind == "all-to-all" else 1.0
        kv = (FP32 + lin) * hkv + 2 * kv_heads / t * FP32  # the key norm as the query's; both inverse RMSs
        kv += hkv * FP32 if (lin != FP32 or not k_eq_v) else 0.0  # the value norm's fp32 input
        kv += 2 * hkv * rep * lin  # attention's k and v
    elif lin != w.res:  # a shared block's attention casts its producer's keys (fp32: the key norm's weight promotes)
        a = job.args
        kv = (a.global_kv_heads if block.kind == "full_attention" else a.n_kv_heads) * hd / t * lin
    sdpa = 2 * hq * lin + heads * FP32 + base.mask_saved(job, lay, block) + cp_saved_extra(job, lay)  # q, out; lse
    saved = base.norm_saved(job, lay, block, w, readers) + q_norm + kv + sdpa + base.post_norm_saved(job, lay, block, w)
    projections = hq + (hkv * (1 if k_eq_v else 2) if kv_heads else 0.0) + job.args.dim  # wq (, wk, wv), wo
    # SDPA's output and log-sum-exp are ops the policy keeps; FlexAttention (a GPU's sliding
    # window or packed documents) is no op on its list (forja/parallel/ac.py): recomputed.
    flex = job.gpu and job.args.attention == "flex" and (block.kind == "sliding_attention" or job.document_mask)
    return saved, projections * lin + (0.0 if flex else hq * lin + heads * FP32)


def gemma4_ffn_saved(job: Job, lay: Layout, block: BlockShape, w: base.Widths) -> tuple[float, float]:
    """(saved bytes per token of a Gemma 4 block's feed-forward half and per-layer input, of
    which op-level AC keeps: the matmuls' outputs)."""
    a, t, lin = job.args, lay.tp, w.lin
    f = block.gemma4[4] / t
    # Under TP torchao's float8 row-parallel style keeps a one-byte copy of w2's input in its place.
    product = 1 - lin if job.float8 and t > 1 else 0.0
    saved = base.norm_saved(job, lay, block, w, readers=2) + (4 * lin + product) * f  # w1, w3; GeGLU
    matmuls = (2 * f + a.dim) * lin
    if block.ffn == "moe":
        experts, experts_mm = _experts(job, lay, w)
        saved += base.post_norm_saved(job, lay, block, w) + experts  # post_mlp_norm, the mixture
        matmuls += experts_mm
        saved += 2 * _norm_of_sum(job, lay, block, w)  # post_moe_norm, post_ffn_norm
    else:
        saved += base.post_norm_saved(job, lay, block, w)  # post_ffn_norm
    ple, ple_mm = _per_layer_input(job, lay, block, w)
    return saved + ple, matmuls + ple_mm


def _norm_of_sum(job: Job, lay: Layout, block: BlockShape, w: base.Widths) -> float:
    """A norm on the experts' output or on its sum with the dense MLP's, both in the stream's
    dtype S (the experts' sum is made in it): the fused kernel keeps its input, eager RMSNorm
    its fp32 input and the normalized x in S, not L."""
    if "rms_norm" in job.fused and not block.zero_centered:
        return job.args.dim * w.res / lay.sp_degree
    return job.args.dim * (FP32 + w.res) / lay.sp_degree


def _experts(job: Job, lay: Layout, w: base.Widths) -> tuple[float, float]:
    """(bytes per token the mixture beside the dense GeGLU keeps, of them matmul outputs); each
    rank routes 1/tp of the tokens (SplitTokens)."""
    a, lin, res = job.args, w.lin, w.res
    D, E, k, h = a.dim, a.n_experts, a.top_k, a.moe_ffn_dim
    router = D * res + D * FP32 + E * FP32  # its norm's normalized x, the gate's fp32 input; softmax's scores
    # int64 a slot: the top-k ids, the slots' sort order and their tokens; fp32 a slot: the weights
    # before and after the per-expert scales, the scales gathered, the sorted slots' weights;
    # and the weights' sum
    routing = 3 * 8 * k + 4 * FP32 * k + FP32
    casts = 2 if lin != res else 1  # w1 and w3 each cast the gathered rows under autocast
    slots = k * ((casts + 4 * h / D + 1) * D * lin + D * FP32)  # rows, GeGLU, output; it times the weight
    kept = router + routing + D * res + slots  # D * res: the experts' norm's normalized x
    matmuls = E * FP32 + k * (2 * h + D) * lin  # the gate's fp32 logits; w1, w3, w2 per slot
    matmuls += base.routing_picks(a) + base.exchanged_rows(lay, k, D, lin)  # kept by op-level AC too
    return kept / lay.tp, matmuls / lay.tp


def _per_layer_input(job: Job, lay: Layout, block: BlockShape, w: base.Widths) -> tuple[float, float]:
    """(bytes per token of h += ple_norm(ple_proj(gelu(ple_gate(h)) * p)), of them matmul outputs):
    token by token on the rank's slice under sequence parallelism, whole over TP otherwise."""
    P = block.gemma4[5]
    if not P:
        return 0.0, 0.0
    sp, D, lin = 1 / lay.sp_degree, job.args.dim, w.lin
    # ple_gate's input (the residual stream, or its cast under autocast); gelu's input and
    # output (the product's gradient for p reads it: p is trained); ple_proj's input (a cast of
    # the fp32 product under autocast); then ple_norm on ple_proj's output.
    kept = sp * (D * lin + 3 * P * lin) + base.post_norm_saved(job, lay, block, w)
    return kept, sp * (P + D) * lin


def per_layer_inputs_saved(job: Job, lay: Layout) -> float:
    """Bytes per token the model keeps of its per-layer inputs (Gemma4.per_layer_inputs), made
    once before the first block, L blocks x P wide: their norm's fp32 input, inverse RMS (one a
    block) and normalized x (in the projection's dtype L), the inputs themselves (S: the table's
    dtype, which the norm's fp32-weighted output promotes to) that every block reads until its
    backward, and under autocast the projection's own cast of the embedded tokens (else the first
    block's input, counted there). Token by token on the rank's slice under sequence
    parallelism; 0 without them."""
    a = job.args
    width = getattr(a, "ple_dim", 0) * a.n_layers
    if not width:
        return 0.0
    w = base.widths(job)
    cast = a.dim * w.lin if w.lin != w.res else 0.0
    return (width * (FP32 + w.lin + w.res) + a.n_layers * FP32 + cast) / lay.sp_degree
