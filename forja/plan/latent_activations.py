"""What a multi-head latent attention (MLA) sublayer saves for its backward, per token: its
latents' norms and its attention, apart from forja/plan/activations.py, which adds the pre-norm
before it (its output read by two projections, wq_a or wq and wkv_a) and DeepSeek Sparse
Attention's selection.

Read off forja/models/common/mla.py and torch's SDPA (aten/src/ATen/native/transformers:
attention.cpp, sdp_utils_cpp.cpp, cuda/sdp_utils.cpp), measured in
tests/unit/plan/test_latent_activations.py:

- The query latent (q_lora_rank wide, when there is one) and the key/value latent (kv_lora_rank)
  each pass an RMSNorm: its input as it reads it (an fp32 copy of a bf16 projection's output;
  in fp32 the projection's output itself, of which c_kv is a view: all of wkv_a's output, the
  shared rotary key part too), the normalized x in the input's dtype, its output as the next
  projection reads it, the statistics. The latents stay whole on every TP rank.
- Attention. Values are narrower than keys (v_head_dim < qk_nope_head_dim + qk_rope_head_dim),
  which no CPU kernel takes: CPU flash attention wants one head width for q, k and v, so SDPA
  falls back to its math path, whatever the dtype. That path upcasts bf16 q, k, v to fp32
  (unless torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp is set; forja does not) and
  keeps q and k scaled by sqrt(scale), the fp32 (B, H, T, T) softmax output and v in fp32 (each
  a copy); its output is cast back and wo keeps the (B, T, H dv) copy it reads; the mask is
  added in place and kept by nothing. On CUDA flash attention refuses different widths too,
  but the memory-efficient kernel takes them (and cuDNN's, where torch prefers it on Hopper and
  Blackwell): either keeps q and k (each the concatenation of the nope and rotary parts), v as
  it is handed over (a view of wkv_b's output, so all of that output), its output (which wo
  reads as it is) and the log-sum-exp; checked on the rehearsal's stand-in for that kernel
  (forja/train/rehearse/kernels.py), not on a GPU. CPU flash attention, where a model's values
  are as wide as its keys, keeps the same.
- Op-level AC keeps the five projections' outputs, and of attention the math path's two
  batched matmuls (the fp32 scores and output) or the kernel's output and log-sum-exp.

Under context parallelism (forja/parallel/cp) the kernel's count stands, with q, k, v as they
arrive (v_head_dim wide) and the CP's own extra (forja/plan/context_parallel.py): not measured
here.
"""

from __future__ import annotations

from forja.models.common.mla import LatentAttentionArgs
from forja.plan.context_parallel import cp_saved_extra
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.saved_parts import FP32, Widths, mask_saved
from forja.plan.shape import BlockShape


def math_attention(job: Job, lay: Layout) -> bool:
    """Whether SDPA runs its math path: on a CPU (no CP), values narrower (or wider) than keys."""
    a: LatentAttentionArgs = job.args
    return not job.gpu and lay.cp == 1 and a.v_head_dim != a.qk_nope_head_dim + a.qk_rope_head_dim


def latent_norm_saved(job: Job, w: Widths, width: int, view_of: int) -> float:
    """Bytes per token one latent's RMSNorm keeps: `width` wide, read from a projection's output
    `view_of` wide (a view of it when wider). One kernel (the fused norm) keeps its input as
    given and its statistics; the eager norm upcasts a bf16 input (in fp32 the input is the
    projection's output: all of it) and keeps the normalized x too."""
    if "rms_norm" in job.fused:
        return 2 * width * w.lin + FP32  # input rows, output; statistics
    given = width * FP32 if w.lin != FP32 else view_of * FP32
    return given + 2 * width * w.lin + FP32  # normalized x (input's dtype), output as read; statistics


def latent_attention_saved(job: Job, lay: Layout, block: BlockShape, w: Widths) -> tuple[float, float]:
    """(saved bytes per token of an MLA sublayer past its pre-norm, of which op-level AC keeps)."""
    a: LatentAttentionArgs = job.args
    t = lay.tp
    heads, nope, rope, dv = a.n_heads / t, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    hq, v_width, kv_out = heads * (nope + rope), heads * dv, heads * (nope + dv)  # q (and k), v, wkv_b's output
    latents = latent_norm_saved(job, w, a.kv_lora_rank, a.kv_lora_rank + rope)
    latents += latent_norm_saved(job, w, a.q_lora_rank, a.q_lora_rank) if a.q_lora_rank else 0.0
    # wq_a (or wq) and wq_b, wkv_a and wkv_b, wo: the projections' outputs
    projections = (a.q_lora_rank + hq + a.kv_lora_rank + rope + kv_out + a.dim) * w.lin
    if math_attention(job, lay):
        scores = heads * job.seq_len * FP32  # softmax's fp32 (T, T) per head
        sdpa = (2 * hq + v_width) * FP32 + scores + v_width * w.lin  # fp32 q, k, v; wo's input
        return latents + sdpa, projections + scores + v_width * FP32  # the two bmm outputs, fp32
    v_kept = kv_out if lay.cp == 1 else v_width  # v a view of wkv_b's output, or as CP hands it over
    sdpa = (2 * hq + v_kept + v_width) * w.lin + heads * FP32  # q, k, v; out (wo's input); log-sum-exp
    sdpa += cp_saved_extra(job, lay) + mask_saved(job, lay, block)
    return latents + sdpa, projections + v_width * w.lin + heads * FP32
