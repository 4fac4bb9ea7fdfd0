"""The memory model's multi-head latent attention (forja/plan/latent_activations.py) against the
tensors MLA blocks really keep on a CPU, in fp32 and under bf16 autocast: DeepSeek-V3's dense and
MoE blocks, DeepSeek-V3.2's (sparse attention's selection over them), Kimi Linear's MLA block
(no query latent), and a V3 block whose values are as wide as its keys; and a GPU job's count
against the memory-efficient kernel the rehearsal stands in on fake tensors. Values narrower
than keys send CPU SDPA down its math path, which keeps the fp32 scores; a GPU's kernels do not."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from forja.models import model_args
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.memory import block_activations, weight_casts
from forja.plan.shape import model_shape
from forja.train.rehearse.kernels import gpu_attention
from tests.unit.plan.kept import block_under_op_level_ac, saved_through_aliases
from tests.unit.plan.test_shape_activations import block_inputs, built, predicted_and_saved, saved_bytes

# (family, flavor, layer, overrides): V3 dense and MoE; V3.2's selection (top-k 8 of 64 keys);
# Kimi Linear's MLA block (no query latent, no rotation); V3 with values as wide as keys.
BLOCKS = {
    "deepseek_v3-dense": ("deepseek_v3", "debug", "0", {}),
    "deepseek_v3-moe": ("deepseek_v3", "debug", "1", {}),
    "deepseek_v32-dense": ("deepseek_v32", "debug", "0", {}),
    "kimi_linear-mla": ("kimi_linear", "debug", "3", {}),
    "deepseek_v3-wide-values": ("deepseek_v3", "debug", "1", {"v_head_dim": 48}),
}


def _qkv(family: str, flavor: str, **overrides) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, H, T, ...) of the widths the flavor's MLA hands SDPA."""
    a = built(family, flavor, tuple(sorted(overrides.items()))).args
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q, k = (torch.randn(2, a.n_heads, 64, qk) for _ in range(2))
    return q, k, torch.randn(2, a.n_heads, 64, a.v_head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_sdpa_takes_its_math_path_for_values_narrower_than_keys(dtype):
    """The cause of the fp32 scores: CPU flash attention wants q, k and v of one head width."""
    q, k, v = (t.to(dtype) for t in _qkv("deepseek_v3", "debug"))
    assert v.shape[-1] < q.shape[-1]
    assert SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True)) == SDPBackend.MATH
    q, k, v = (t.to(dtype) for t in _qkv("deepseek_v3", "debug", v_head_dim=48))
    assert SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True)) == SDPBackend.FLASH_ATTENTION


# Measured predicted / saved, fp32 and bf16: V3 dense 0.995, 0.995; V3 MoE 0.996, 0.998; V3.2
# dense 0.995, 1.010 (the untrained indexer's weight casts, which nothing keeps, are priced);
# Kimi Linear 1.000, 1.002; wide values (CPU flash) 0.996, 0.998. Before this count (the kernel's
# q, k, v, output and log-sum-exp everywhere; the latents' norms over-counted): 0.986, 0.884;
# 0.989, 0.918; 1.005, 0.918; 0.934, 0.890; 1.020, 1.014.
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BLOCKS)
def test_a_latent_attention_block_saves_what_the_planner_counts(name, bf16):
    family, flavor, layer, overrides = BLOCKS[name]
    predicted, actual = predicted_and_saved(family, flavor, layer, bf16=bf16, **overrides)
    print(f"{name} {'bf16' if bf16 else 'fp32'}: predicted / saved {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.02)


# Measured 1.000 in each; before (fp32, bf16): V3 dense 0.848, 0.711; Kimi Linear 0.791, 0.651;
# wide values 0.904, 0.900 (the projections' outputs counted as a plain attention's, and on the
# math path the kernel's output and log-sum-exp for its two batched matmuls, the fp32 scores).
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["deepseek_v3-dense", "kimi_linear-mla", "deepseek_v3-wide-values"])
def test_op_level_ac_keeps_a_latent_blocks_matmul_outputs(name, bf16):
    family, flavor, layer, overrides = BLOCKS[name]
    predicted, actual = block_under_op_level_ac(family, flavor, layer, bf16, **overrides)
    print(f"{name} {'bf16' if bf16 else 'fp32'} op-level: predicted / kept {predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.01)


def test_the_math_path_keeps_no_document_mask():
    """SDPA's math path adds a dense mask to the scores in place: rows of two documents keep what
    causal rows do, and the planner prices them alike on a CPU."""
    model = built("deepseek_v3", "debug")
    B, T = 2, 64
    h, rope, causal = block_inputs(model, "0", B, T)
    documents = torch.tensor([[0] * 30 + [1] * 34, [0] * 50 + [1] * 14])
    dense = model.mask_for("full_attention", documents, T, 0, torch.device("cpu"))
    assert dense.dense is not None and causal.dense is None
    assert saved_bytes(model.layers["0"], h, rope, dense) == saved_bytes(model.layers["0"], h, rope, causal)
    priced = []
    for document_mask in (False, True):
        job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=False,
                  document_mask=document_mask)
        priced.append(block_activations(job, Layout(micro_batch_size=B), job.shape.blocks[0], 0)[0])
    assert priced[0] == priced[1]


def test_only_a_cpu_keeps_latent_attentions_scores():
    """DeepSeek-V2-Lite (16b) at T 4096 and 8192, bf16: on a GPU its kernel keeps nothing per key
    (the bytes per token stay as they are); on a CPU the math path's fp32 scores grow with T."""
    args = model_args("deepseek_v3", "16b")
    per_token = {}
    for gpu in (False, True):
        for T in (4096, 8192):
            job = Job(shape=model_shape(args, T), seq_len=T, global_batch_size=8, gpu=gpu, bf16=True)
            per_token[gpu, T] = block_activations(job, Layout(micro_batch_size=1), job.shape.blocks[1], 1)[0]
    assert per_token[True, 8192] == per_token[True, 4096]
    assert per_token[False, 8192] - per_token[False, 4096] == pytest.approx(args.n_heads * 4096 * 4)
    assert per_token[False, 4096] - per_token[True, 4096] > args.n_heads * 4096 * 4


# Measured predicted / saved (fp32, bf16): 0.995, 0.994 with a query latent, 0.994, 0.994
# without; before (the latents' norms priced as 3 (r_kv + d_r + 2 r_q) a token, v as wide as
# itself): 1.022, 1.018 and 0.964, 0.997.
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("q_lora_rank", [64, 0])
def test_a_latent_block_on_a_gpus_kernel_saves_what_the_planner_counts(q_lora_rank, bf16):
    """A GPU job's count (the kernel keeps q, k, all of wkv_b's output through v, the output and
    the log-sum-exp) against DeepSeek-V3's dense debug block on that kernel."""
    model = built("deepseek_v3", "debug", (("q_lora_rank", q_lora_rank),))
    B, T = 2, 64
    h, rope, mask = block_inputs(model, "0", B, T)
    actual = saved_through_aliases(model.layers["0"], h, rope, mask, fake=True, bf16=bf16, within=gpu_attention)
    job = Job(shape=model_shape(model.args, T), seq_len=T, global_batch_size=B, gpu=True, bf16=bf16)
    lay, shape = Layout(micro_batch_size=B), job.shape.blocks[0]
    predicted = block_activations(job, lay, shape, 0)[0] * B * T + weight_casts(job, lay, shape, 0)
    print(f"q_lora_rank {q_lora_rank} {'bf16' if bf16 else 'fp32'} GPU kernel: predicted / saved "
          f"{predicted / actual:.3f}")
    assert predicted == pytest.approx(actual, rel=0.02)
