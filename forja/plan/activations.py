"""What one block saves for its backward, per token, by the kind of block it is: the
activation half of the memory model (forja/plan/memory.py walks the step with it).

Every count below names the tensors autograd keeps, read off forja's own modules;
tests/unit/plan/test_shape_activations.py checks each kind of block against the tensors
autograd really saves (docs/planner.md lists the measured ratios). Per token means per
token of the micro-batch on this rank: a tensor of the whole sequence's (T, T) scores is
T per token per head.

- Attention (full or sliding): SDPA/FlexAttention keep q, k, v, the output and the
  log-sum-exp; a sliding window changes none of them, only the dense mask SDPA is handed
  (FlexAttention's block mask holds no per-token state). Attention sinks without
  FlexAttention (on CPUs, or model.attention = "sdpa") write the scores out in fp32.
- Multi-head latent attention (DeepSeek-V3, Kimi Linear): its latents' norms, and on CPUs
  SDPA's math path with its fp32 scores (values narrower than keys; latent_activations.py).
- Gated DeltaNet (linear_attention): the convolutions' inputs, the gates, the chunked delta
  rule's per-chunk tensors and one state per chunk boundary, and the gated output norm; on
  CUDA with flash-linear-attention its kernel keeps only its inputs and one C-wide matrix.
- Norms: pre-norm, sandwich (pre and post, Gemma 3) or post-norm (OLMo 2/3) blocks.
- Feed-forwards: SwiGLU (fused or not), GeGLU, GELU, mixture of experts (SwiGLU or
  gpt-oss's clamped SwiGLU, shared experts and their gate).
"""

from __future__ import annotations

import math
from dataclasses import replace

from forja.models.common.kimi_delta_attention import KimiDeltaArgs
from forja.models.common.mla import LatentAttentionArgs
from forja.plan.context_parallel import compressed_block, compressed_keys, cp_saved_extra, mixer_length, replicas
from forja.plan.gemma4_activations import gemma4_attention_saved, gemma4_ffn_saved
from forja.plan.job import Job
from forja.plan.kda_activations import kda_saved
from forja.plan.latent_activations import latent_attention_saved, math_attention
from forja.plan.layout import Layout
from forja.plan.saved_parts import (  # noqa: F401  (FP32, Widths, widths: read from here by memory.py and tests)
    FP32,
    Widths,
    exchanged_rows,
    input_copies,
    mask_saved,
    norm_saved,
    post_norm_saved,
    regathered,
    routing_picks,
    sp_share,
    sublayer_input,
    widths,
)
from forja.plan.shape import BlockShape
from forja.plan.v4_activations import v4_block_saved


def attention_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> tuple[float, float]:
    """(saved bytes per token of one block's sequence-mixing half, of which matmul/attention outputs)."""
    if block.gemma4:  # each Gemma 4 block by its own heads
        return gemma4_attention_saved(job, lay, block, w)
    if block.kind == "linear_attention" and isinstance(job.args, KimiDeltaArgs):  # Kimi Delta Attention's own count
        mixer, matmuls = kda_saved(job, lay, block, w.lin)
        return norm_saved(job, lay, block, w, readers=6) + mixer, matmuls  # wq wk wv wb wf_a wg_a
    if block.kind == "linear_attention":
        return linear_attention_saved(job, lay, block, w)
    if block.kind == "mamba2":
        return mamba2_saved(job, lay, block, w)
    if block.kind in ("mlp", "moe"):  # a block that is only a feed-forward (Nemotron-H)
        return 0.0, 0.0
    if isinstance(job.args, LatentAttentionArgs):  # its latents' norms, its own SDPA path (latent_activations.py)
        mixer, matmuls = latent_attention_saved(job, lay, block, w)
        return sublayer_input(job, lay, block, w, 2) + mixer + indexer_saved(job, lay, block, w), matmuls  # wq_a, wkv_a
    a, t = job.args, lay.tp
    hq, hkv, heads = a.n_heads * a.head_dim / t, a.n_kv_heads * a.head_dim / t, a.n_heads / t
    # All-to-all CP: SDPA keeps k and v as they arrive, a KV head per rank when cp exceeds them.
    rep = replicas(a.n_kv_heads / t, lay.cp) if lay.cp > 1 and lay.cp_kind == "all-to-all" else 1.0
    # QK-norm (per head or over the whole projection alike): its input upcast, the normalized x
    # (fp32 in a (1 + w) norm; such blocks' QK-norms are (1 + w) too).
    qk_norm = (FP32 + (FP32 if block.zero_centered else w.lin)) * (hq + hkv) if a.qk_norm else 0.0
    if block.unit_qk:  # Llama 4's weightless per-head RMS: q and k in fp32, and their inverse RMS per head
        qk_norm += FP32 * (hq + hkv + heads + a.n_kv_heads / t)
    # DeepSeek-V4's attention always writes its scores out (compressed_attention.py `attend`).
    flex = job.gpu and a.attention == "flex" and not compressed_block(job, block)
    written_out = block.sinks and not flex  # `_attend_with_sinks` (DeepSeek-V4's attention too)
    T = compressed_keys(job, lay, block) if compressed_block(job, block) else job.seq_len  # keys a query scores
    if written_out:  # the scores written out
        sdpa = 3 * hq * w.lin  # q, and k and v repeated to every query head, as the matmuls take them
        sdpa += heads * (T + 1) * FP32  # softmax's fp32 output, the sink's column included
        sdpa += heads * T * w.lin if w.lin != FP32 else 0.0  # its cast for probs @ v under autocast
        sdpa += hq * w.lin + T / lay.sequences_per_microbatch(job.global_batch_size)  # out; bool (T, T) mask
    else:
        sdpa = (2 * hq + 2 * hkv * rep) * w.lin + heads * FP32  # q, k, v, out (every query head's); log-sum-exp
        sdpa += cp_saved_extra(job, lay)  # ring's fp32 output, or all-to-all's full-sequence one
        sdpa += 2 * heads * FP32 if block.sinks else 0.0  # FlexAttention's sinks: sigmoid(lse - sink), its cast
        sdpa += mask_saved(job, lay, block)
    gate = 2 * hq * w.lin if block.output_gate else 0.0  # sigmoid(x W_g) and the gated output (wo's input)
    post = post_norm_saved(job, lay, block, w) if block.norms != "pre" else 0.0
    # Op-level AC keeps the projections' outputs (q, k, v before RoPE; wo's) and attention's: the
    # kernel's output and log-sum-exp, or written out its two bmms' (the scores and probs @ v),
    # each in the matmuls' dtype (autocast casts the fp32 operands back; the fp32 softmax is recomputed).
    attention = heads * T * w.lin if written_out else heads * FP32
    matmuls = (2 * hq + 2 * hkv + a.dim) * w.lin + attention + gate / 2
    readers = 4 if block.output_gate else 3  # wq, wk, wv (, wg)
    return sublayer_input(job, lay, block, w, readers) + qk_norm + sdpa + gate + post, matmuls


def indexer_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> float:
    """Bytes per token a DeepSeek Sparse Attention block's selection keeps (replicated over TP), as
    forja computes it (forja/models/common/sparse_attention.py): the selected keys are a (B, 1, T, T)
    boolean mask over dense SDPA, which keeps it as an additive bias (the compute dtype on GPUs)
    where rows are longer than top-k (shorter ones, and the dense warm-up, run causal: no mask).
    On a CPU without CP SDPA's math path adds it in place and keeps nothing of it (its values
    are narrower than its keys: latent_activations.py). Under all-to-all CP that bias covers the
    whole rows, cp times a rank's tokens; under ring the plan keeps the rank's queries' selection
    as booleans (a byte a key), each block's mask cut from it as it runs. The untrained indexer
    runs without gradients: its scores, (B, T, chunk, T) at a time (`INDEXER_HEAD_CHUNK`), are
    transients that nothing keeps (op-level AC recomputes them, forja/parallel/ac.py). Trained (a
    dsa_stage), also its query heads, key and fp32 weights, each head's ReLU scores over the T
    keys and the summed scores' log-softmax (under CP a rank's queries by the whole rows' keys:
    the same per token)."""
    if not block.indexer:
        return 0.0
    heads, width, topk, stage = block.indexer
    masked = stage != 1 and job.seq_len > topk and not math_attention(job, lay)
    bias = 2 if job.gpu and job.bf16 else FP32
    if lay.cp > 1:
        bias = 1 if lay.cp_kind == "ring" else bias * lay.cp
    kept = job.seq_len * bias if masked else 0.0
    if stage:
        kept += (heads * width + width) * w.lin + heads * FP32 + (heads + 2) * job.seq_len * FP32
    return kept


def linear_attention_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> tuple[float, float]:
    """(saved bytes per token of a Gated DeltaNet mixer and its norm, of which matmul outputs).

    Per value head and token the chunked reference (forja/models/common/gated_delta_rule.py,
    all fp32) keeps: q and k before and after their L2 norm, k * beta, the WY solves' w (and
    u, v * beta's v, each chunk's new values: 3 dv), q read against the state, k decayed to
    the chunk's end, and the matmuls' contiguous copies of k^T, q and the per-chunk operands
    (12 dk in all over two or more chunks; in one chunk 6, or 10 with q and k repeated to the
    value heads); the C x C decay, k k^T, the system, q k^T and the masked scores (5 C); the
    norms' statistics and the decays (7); and the state (dk, dv) at every chunk's start. Under autocast the
    matmuls' operands are bf16 casts instead (6 dk, dv, 3 C, the state twice per chunk) and
    the rest stays fp32 (6 dk, 2 dv, 2 C). Packed documents pad each to whole chunks (up to
    C - 1 more tokens per document in the rule's tensors), which the count leaves out: it
    depends on the documents' lengths."""
    n_k, n_v, dk, dv, taps, C = block.mixer
    t, T = lay.tp, mixer_length(job, lay)  # under ring CP a rank scans its T/cp shard
    key, value, hv = n_k * dk / t, n_v * dv / t, n_v / t
    conv = (2 + (taps - 1) / T) * (2 * key + value) * w.lin  # each convolution's input (window too), SiLU's input
    gates = hv * (w.lin + 2 * FP32)  # beta's sigmoid; the decay's softplus input and its product
    chunks = math.ceil(T / C)
    if job.gpu and job.fla:  # fla's kernel: L2-normalized q, k and their norms, v, g, beta, its (T, C) matrix
        rule = hv * ((2 * dk + dv + 1 + C) * w.lin + 3 * FP32)
    elif w.lin == FP32:
        # One chunk: views need no copies unless q and k were repeated to the value heads.
        dk_tensors = 12 if chunks > 1 else (10 if n_v > n_k else 6)
        per_head = dk_tensors * dk + 3 * dv + 5 * min(C, T) + 7 + chunks * dk * dv / T
        rule = hv * per_head * FP32
    else:  # under autocast the matmuls keep bf16 casts of their operands, the rest stays fp32
        kept32 = 6 * dk + 2 * dv + 2 * min(C, T) + 7 + dk * dv / T
        casts = 6 * dk + dv + 3 * min(C, T) + 2 * chunks * dk * dv / T  # the state cast twice per chunk
        rule = hv * (kept32 * FP32 + casts * w.lin)
    # The gated norm: the rule's output and the gate upcast, the normalized output, weight * it,
    # silu(gate) (fp32 alike) and their product cast back for wo; its statistics.
    out = value * (4 * FP32 + 2 * w.lin) + hv * FP32
    # Op-level AC keeps the projections' outputs: q, k, v, z, beta's and the decay's (a number a
    # head each), wo's. Not the rule's output: fla's kernel is an autograd Function, whose forward
    # runs without gradients (the policy keeps nothing of it); the reference's is a sum of two
    # of its batched matmuls' outputs, counted below.
    matmuls = (2 * key + 2 * value + 2 * hv + job.args.dim) * w.lin
    if not (job.gpu and job.fla):  # the chunked reference's own matmuls, over whole chunks (padded):
        # k_beta k^T and q k^T (C x C a chunk), w S, q S and attn v_new (dv each), k^T v_new (a state a chunk)
        matmuls += hv * (chunks * C / T * (2 * C + 3 * dv) + chunks * dk * dv / T) * w.lin
    return norm_saved(job, lay, block, w, readers=6) + conv + gates + rule + out, matmuls  # wq wk wv wz wb wa


def mamba2_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> tuple[float, float]:
    """(saved bytes per token of a Mamba-2 mixer and its norm, of which matmul outputs).

    The projections' outputs z, x, B, C, dt; each convolution's input (window too) and output
    (SiLU's input); x after SiLU as the scan and the D skip read it (under autocast their two
    fp32 copies); the time step's softplus input, clamp input and dt itself; the chunked scan
    (`ssd_scan_saved`); the gated grouped norm: its input y, z (upcast), silu(z), their
    product, the normalized product (fp32 alike), its weighted copy as wo reads it, and the
    statistics. Op-level AC keeps the projections' outputs and the scan's batched matmuls'."""
    H, P, G, N, taps, C = block.mamba2
    t, T = lay.tp, mixer_length(job, lay)  # under ring CP a rank scans its T/cp shard
    h, inner, bc = H / t, H * P / t, G * N / t
    conv = (2 + (taps - 1) / T) * (inner + 2 * bc) * w.lin + inner * (FP32 if w.lin == FP32 else 2 * FP32)
    steps = h * 3 * FP32
    scan, scan_mm = ssd_scan_saved(T, C, P, N, w)
    norm_out = inner * (5 * FP32 + w.lin) + G / t * FP32
    matmuls = (2 * inner + 2 * bc + h + job.args.dim) * w.lin + h * scan_mm
    return norm_saved(job, lay, block, w, readers=5) + conv + steps + h * scan + norm_out, matmuls


def ssd_scan_saved(T: int, C: int, P: int, N: int, w: Widths) -> tuple[float, float]:
    """(saved bytes per token and head of the PyTorch chunked scan, forja/models/common/
    mamba2_scan.py `chunk_scan`, of which its batched matmuls' outputs), in n = ceil(T / C)
    chunks padded to C tokens (r: padded tokens per token).

    In fp32 (the compute dtype, whatever the input's): the C x C decay, B and C padded, the
    decays to the chunk's end and from its start, each chunk's incoming state. The einsums'
    operands and outputs (fp32, or their bf16 casts under autocast): the scores C B^T and the
    decayed scores (C each), x dt twice (its two einsums' layouts), C and B for the scores,
    B decayed to the chunk's end, C decayed from its start for every chunk after the first
    (the first reads a zero state that needs no gradient). Under autocast also x's fp32 copy
    and each state's cast. Op-level AC keeps the einsums' outputs: the scores, the outputs
    within the chunk and from the incoming state (P each), each chunk's own state (P x N)."""
    n = math.ceil(T / C)
    r = n * C / T
    autocast = w.lin != FP32
    # The last chunk's state update, which nothing reads, frees what it saved once the forward
    # returns: under autocast its fp32 input; in one chunk the whole path that writes the state
    # (B decayed to the chunk's end, x dt in its layout, B padded, the decay to the end).
    writes = n > 1
    kept32 = (C + (1 + writes) * N + 1 + writes) * r + (n - autocast) * P * N / T + n / T
    operands = (2 * C + (1 + writes) * P + (1 + writes + (writes and not autocast)) * N) * r
    operands += (n - 1) * C * N / T + (n * P * N / T if autocast else 0.0)
    matmuls = (C + 2 * P) * r + n * P * N / T
    return kept32 * FP32 + operands * w.lin, matmuls * w.lin


def ffn_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> tuple[float, float]:
    """(saved bytes per token of one block's feed-forward half, of which matmul outputs)."""
    if block.gemma4:  # its own GeGLU width, the experts beside it, the per-layer input
        return gemma4_ffn_saved(job, lay, block, w)
    if block.ffn == "none":  # a block that is only a sequence mixer (Nemotron-H)
        return 0.0, 0.0
    a, t = job.args, lay.tp
    autocast = w.lin != w.res  # bf16 matmuls over an fp32 residual stream
    ups = 1 if block.expert_activation == "relu2" else 2  # Nemotron 3's experts have no gate: w1 alone
    if block.ffn == "moe":
        # Under autocast the router keeps the fp32 input itself, and the shared experts' w1, w3
        # and their gate each their own bf16 cast (the routed rows are gathered copies, below),
        # as latent experts' projection down does.
        shared_readers = ((ups + block.shared_expert_gate) if a.shared_width else 0) + bool(block.expert_width)
        norm = sublayer_input(job, lay, block, replace(w, gathered=1.0, float8_gathered=False), 1)  # no gather
        norm += (shared_readers * a.dim * w.lin + a.dim * (w.res - w.lin)) if autocast else 0.0
    else:
        norm = sublayer_input(job, lay, block, w, 1 if block.ffn in ("gelu", "relu2") else 2)  # w1 (, w3)
    norm += post_norm_saved(job, lay, block, w) if block.norms != "pre" else 0.0
    gated = 3 if "swiglu" in job.fused else 4  # gate, up, silu(gate), product; fused: no silu output
    if block.ffn in ("gelu", "relu2"):  # the first matmul's output and the activation's (relu(x), its square)
        f = a.ffn_dim / t
        return norm + 2 * f * w.lin, (f + a.dim) * w.lin
    if block.ffn in ("swiglu", "geglu"):  # GeGLU never takes the fused kernel: gelu's input, output, up, product
        f = a.ffn_dim / t
        # Under TP torchao's float8 row-parallel style casts w2's input before the matmul, which
        # keeps that one-byte copy of the product in its place.
        product = 1 - w.lin if job.float8 and t > 1 else 0.0
        return norm + ((gated if block.ffn == "swiglu" else 4) * w.lin + product) * f, (2 * f + a.dim) * w.lin
    # Under TP each rank routes and computes the MoE layer for its 1/tp of the tokens
    # (forja/models/common/tp_plan.py, SplitTokens): per token of the sequence, 1/tp of it.
    k, h = a.top_k, a.moe_ffn_dim
    cf = a.capacity_factor if a.capacity_factor > 0 else 1.0
    # Latent experts (Nemotron 3 Super) compute in width L on the projection's output, a matmul's
    # (its dtype w.lin, one cast for every reader); projected back up from the (N, L) sum, kept.
    L, latent = block.expert_width or a.dim, bool(block.expert_width)
    casts, source = (1 if latent or not autocast else ups), (w.lin if latent else FP32)
    # The clamped SwiGLU keeps 7 hidden-wide tensors: gate and up (biased), the clamped gate,
    # its sigmoid, up + 1, gate * sigmoid and the product; SwiGLU 4 (3 fused) as above.
    # Squared ReLU (relu2) keeps 2: relu(up) and its square.
    act = {"clamped_swiglu": 7, "relu2": 2}.get(block.expert_activation, 4)
    # Per slot: the rows sorted in (under autocast w1 and w3 each keep their own bf16 cast of
    # fp32 rows), the experts' output, and it times the fp32 weights (index_add's source, in the
    # rows' dtype); the expert FFN.
    routed = cf * k * ((casts + 1 + act * h / L) * L * w.lin + L * source) + latent * L * w.lin
    shared = a.shared_width * (gated if ups == 2 else 2) * w.lin
    if a.shared_width and block.shared_expert_gate:
        shared += a.dim * w.lin + FP32  # the shared output and its sigmoid gate, kept for the product
    router = a.n_experts * FP32 * 2 + k * 24  # logits, scores; indices
    router += a.dim * FP32 if w.res != FP32 else 0.0  # the router's fp32 copy of a bf16 input
    # Op-level AC keeps every matmul's output: the routed experts' grouped ones (latent experts'
    # projections too), the router's fp32 logits, the shared experts' (w2's too) and their gate's.
    matmuls = (cf * k * (ups * h + L) + latent * (L + a.dim)) * w.lin + a.n_experts * FP32
    if a.shared_width:
        matmuls += (ups * a.shared_width + a.dim + block.shared_expert_gate) * w.lin
    matmuls += routing_picks(a) + exchanged_rows(lay, cf * k, L, w.lin)
    return norm + (routed + shared + router) / t, matmuls / t


def mtp_saved(job: Job, lay: Layout, w: Widths) -> float:
    """Bytes per token a multi-token prediction module keeps beyond its block: the embedding's
    and the previous depth's norms and its own final norm (input and normalized x each), and
    the (B, T, 2d) concatenation its projection reads."""
    return 3 * 2 * sp_share(lay) * job.args.dim * w.res + 2 * job.args.dim * w.lin


def block_activations(job: Job, lay: Layout, block: BlockShape, index: int) -> tuple[float, float]:
    """(bytes one block keeps per token until its backward, bytes its backward needs at once
    on top: recomputation under AC plus the gradient working set)."""
    w = replace(widths(job), float8_gathered=job.float8 and lay.sp_degree > 1)
    if compressed_block(job, block):  # DeepSeek-V4's: hc_mult streams in, its own count (v4_activations.py)
        full, attn_mm = v4_block_saved(job, lay, block, w.lin, w.res, compressed_keys(job, lay, block))
        attn, ffn, ffn_mm = full, 0.0, 0.0
        full += mtp_saved(job, lay, w) if block.mtp else 0.0
        block_input = job.args.hc_mult * job.args.dim * sp_share(lay) * w.res
    else:
        attn, attn_mm = attention_saved(job, lay, block, w)
        ffn, ffn_mm = ffn_saved(job, lay, block, w)
        full = attn + ffn + (mtp_saved(job, lay, w) if block.mtp else 0.0)
        block_input = job.args.dim * sp_share(lay) * w.res
    ffn_width = job.args.ffn_dim if not block.moe else job.args.top_k * job.args.moe_ffn_dim
    ffn_width = 0 if block.ffn == "none" else ffn_width
    ffn_width /= lay.tp  # the dense FFN's columns, or the MoE layer's tokens, split over TP
    # The feed-forward's backward first makes d(product), d(gate) and d(up) beside its saved
    # intermediates; its input's gradient, made twice (by w1 and by w3: whole rows, gathered
    # under SP), comes after those intermediates are freed, so it adds only what exceeds them.
    working = max(3 * ffn_width, 2 * job.args.dim - 3 * ffn_width) * w.lin
    if job.float8 and not job.compiled and not block.moe:
        # Eager float8 (torchao): after d(product), w2's backward casts its saved input for the
        # weight's gradient: x * scale and its clamp in fp32 at once, then the float8 copy
        # (compiled, one kernel does it; routed experts are no float8 linears).
        working = max(working, ffn_width * (w.lin + 2 * FP32 + 1))
    if lay.ac == "full" or (lay.ac == "selective" and lay.ac_every and index % lay.ac_every == 0):
        return block_input, full + working  # recomputed as the forward ran: inputs gathered whole
    if lay.op_level:
        kept = block_input + attn_mm + ffn_mm
        if lay.op_level_alternate:
            kept -= (alternate_recomputed(job, lay, block) or (0.0, 0.0))[0] * w.lin
        return kept, (full - kept) + working
    if regathered(job, lay, w) and not compressed_block(job, block):
        split = replace(w, gathered=1 / lay.tp)
        kept = attention_saved(job, lay, block, split)[0] + ffn_saved(job, lay, block, split)[0] + (full - attn - ffn)
        return kept, working + job.args.dim * w.lin  # backward gathers the input whole again
    return full, working


def alternate_recomputed(job: Job, lay: Layout, block: BlockShape) -> tuple[float, float] | None:
    """(output elements, forward FLOPs) per token, on one rank, of the `mm` calls that op-level
    AC with parallel.ac_matmuls = "alternate" recomputes in one block: the 2nd, 4th, ... of its
    calls in order (attention's wq, wk, wv, wo; then a dense FFN's w1, w3, w2, or an MoE layer's
    router and shared experts' w1, w3, w2: the routed experts' grouped matmuls are no `mm`).
    None where the block's calls are not modelled (latent or linear attention, an output gate,
    biased projections, which run as `addmm` and are kept, an MTP module): such a block is
    priced as keeping them all, an over-estimate."""
    a, t = job.args, lay.tp
    if (isinstance(a, LatentAttentionArgs) or block.kind == "linear_attention" or block.output_gate
            or block.sinks or block.layer_norm or block.mtp or block.ffn in ("gelu", "relu2", "none")
            or block.kind in ("mamba2", "mlp", "moe")):
        return None
    hq, hkv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    calls = [(hq / t, a.dim), (hkv / t, a.dim), (hkv / t, a.dim), (a.dim, hq / t)]  # (out, in) per token
    if block.ffn != "moe":
        f = a.ffn_dim / t
        calls += [(f, a.dim), (f, a.dim), (a.dim, f)]
    else:  # each rank routes 1/tp of the tokens (SplitTokens)
        calls.append((a.n_experts / t, a.dim))
        if a.shared_width:
            sh = a.shared_width
            calls += [(sh / t, a.dim), (sh / t, a.dim), (a.dim / t, sh)]
            calls += [(1 / t, a.dim)] if block.shared_expert_gate else []
    dropped = calls[1::2]
    return sum(out for out, _ in dropped), sum(2 * out * inp for out, inp in dropped)
