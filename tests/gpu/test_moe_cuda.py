"""Mixture of experts on a GPU: torch._grouped_mm (CUTLASS, bf16, Hopper and later) against
the per-expert loop, and a whole MoE model training step (skipped without CUDA).

bf16 bound: the largest error over the largest reference value below 2e-2 (the two sum the
inner dimension in other orders and round once each).
"""

from __future__ import annotations

import pytest
import torch

from forja.models import build_model
from forja.ops.grouped_mm import grouped_mm, grouped_mm_fused, grouped_mm_loop, grouped_supported, row_alignment

CUDA = torch.device("cuda")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_grouped_mm_matches_the_loop_in_bf16():
    counts = torch.tensor([0, 512, 64, 1000, 0, 16, 256, 200], device=CUDA)  # uneven, some experts idle
    x0 = torch.randn(int(counts.sum()), 2048, device=CUDA, dtype=torch.bfloat16)
    w0 = torch.randn(8, 768, 2048, device=CUDA, dtype=torch.bfloat16) * 0.02
    if not grouped_supported(x0, w0):
        pytest.skip(f"torch._grouped_mm needs a Hopper-class GPU (this is {torch.cuda.get_device_name()})")
    results = []
    for fn in (grouped_mm_fused, grouped_mm_loop):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w, counts)
        out.float().square().mean().backward()
        results.append((out, x.grad, w.grad))
    for what, got, want in zip(("out", "x.grad", "w.grad"), *results):
        assert _relative(got, want) < 2e-2, what


@pytest.mark.parametrize("counts", [[3, 0, 13, 5], [1, 7, 9, 0], [0, 0, 0, 29], [0, 0, 0, 0]])
@pytest.mark.parametrize("offset_start", [False, True])
def test_groups_whose_starts_are_not_aligned_match_the_loop(counts, offset_start):
    """Group sizes that are not multiples of 8 rows (bf16's 16 bytes), some groups empty:
    grouped_mm pads each group's start before the kernel. With `offset_start` x is a view
    that starts 2 bytes into its storage (not 16-byte aligned); the padded copy is."""
    torch.manual_seed(0)
    M, K, N = sum(counts), 256, 128
    x0 = torch.randn(M, K, device=CUDA, dtype=torch.bfloat16)
    w0 = torch.randn(4, N, K, device=CUDA, dtype=torch.bfloat16) * 0.05
    if not grouped_supported(x0, w0):
        pytest.skip(f"torch._grouped_mm needs a Hopper-class GPU (this is {torch.cuda.get_device_name()})")
    assert row_alignment(x0) == 8
    lead = 1 if offset_start else 8  # bf16 elements before x in its storage: 2 or 16 bytes
    results = []
    for impl in ("grouped", "loop"):
        flat = torch.cat([x0.new_zeros(lead), x0.flatten()]).requires_grad_()  # (lead + M*K,)
        w = w0.clone().requires_grad_()
        x = flat[lead:].view(M, K)
        out = grouped_mm(x, w, torch.tensor(counts, device=CUDA), impl=impl)
        if impl == "grouped":  # grouped_mm_fused's output: the kernel ran, no silent loop
            assert type(out.grad_fn).__name__ == "_ContiguousGradBackward"
        (out.float() * torch.linspace(-1, 1, out.numel(), device=CUDA).view_as(out)).sum().backward()
        torch.cuda.synchronize()  # a device-side assert of the kernel shows here, in this test
        results.append((out, flat.grad[lead:].view(M, K), w.grad))
    if M == 0:  # nothing routed: empty output, zero gradients
        assert results[0][0].shape == (0, N) and not results[0][2].any()
        return
    for what, got, want in zip(("out", "x.grad", "w.grad"), *results):
        assert _relative(got, want) < 2e-2, what


def test_moe_model_trains_a_step_on_the_gpu():
    model = build_model("qwen3", "debug-moe", device=CUDA, dtype=torch.bfloat16)
    tokens = torch.randint(0, model.args.vocab_size, (4, 128), device=CUDA)
    loss = model(tokens, labels=tokens.roll(-1, 1))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.layers["1"].feed_forward.router.expert_bias is None  # qwen3 has none
    ds = build_model("deepseek_v3", "debug", device=CUDA, dtype=torch.bfloat16)
    assert ds.layers["1"].feed_forward.router.expert_bias.dtype == torch.float32  # kept fp32 in bf16 models
    assert torch.isfinite(ds(tokens, labels=tokens))


def test_bf16_autocast_over_fp32_weights_takes_the_grouped_path():
    """The default GPU precision (bf16 autocast, fp32 parameters) runs torch._grouped_mm,
    not the per-expert loop, and agrees with the loop."""
    from forja import fallbacks
    from forja.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, 512, impl="grouped").to(CUDA)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    counts = torch.tensor([0, 300, 17, 500, 0, 64, 100, 43], device=CUDA)
    x = torch.randn(int(counts.sum()), 256, device=CUDA)  # fp32 activations, as the residual stream
    if not grouped_supported(x, experts.w1, torch.bfloat16):
        pytest.skip(f"torch._grouped_mm needs a Hopper-class GPU (this is {torch.cuda.get_device_name()})")
    fallbacks.clear()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = experts(x, counts)
        experts.impl = "loop"
        want = experts(x, counts)
    assert type(out.grad_fn).__name__ == "_ContiguousGradBackward"  # grouped_mm_fused's output
    assert out.dtype == torch.bfloat16 and fallbacks.recorded() == []
    assert _relative(out, want) < 2e-2
    out.float().square().mean().backward()
    assert experts.w1.grad.dtype == torch.float32 and torch.isfinite(experts.w1.grad).all()
