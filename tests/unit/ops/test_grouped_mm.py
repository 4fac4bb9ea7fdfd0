"""The grouped matmul of a mixture of experts: torch._grouped_mm against the per-group loop."""

from __future__ import annotations

import pytest
import torch

from forja import fallbacks
from forja.ops.grouped_mm import compute_dtype, grouped_mm, grouped_mm_fused, grouped_mm_loop, grouped_supported


@pytest.mark.parametrize("counts", [[3, 4, 3, 6], [0, 9, 0, 7], [16, 0, 0, 0], [0, 0, 0, 0]])
def test_grouped_and_loop_agree_forward_and_backward(counts):
    x0 = torch.randn(sum(counts), 32)
    w0 = torch.randn(4, 16, 32)
    if not grouped_supported(x0, w0):
        pytest.skip(f"torch {torch.__version__} has no CPU torch._grouped_mm")  # 2.11: the loop serves alone
    results = []
    for fn in (grouped_mm_fused, grouped_mm_loop):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w, torch.tensor(counts))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_loop_is_the_definition():
    x, w = torch.randn(7, 8), torch.randn(2, 5, 8)
    out = grouped_mm(x, w, torch.tensor([3, 4]), impl="loop")
    torch.testing.assert_close(out, torch.cat([x[:3] @ w[0].T, x[3:] @ w[1].T]))


def _cpu_bf16_grouped() -> bool:
    """Whether this torch has a CPU bf16 kernel (2.13 has fp32 only): asked of the op itself."""
    try:
        grouped_mm_fused(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 8, 8, dtype=torch.bfloat16),
                         torch.tensor([1, 1]))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def test_autocast_decides_by_the_autocast_dtype():
    x, w = torch.randn(8, 16), torch.randn(2, 8, 16)  # fp32, as parameters are under autocast
    assert compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16
        assert grouped_supported(x, w, compute_dtype(x)) == _cpu_bf16_grouped()
    # 12 bf16 columns are 24 bytes: not 16-byte aligned, so never grouped, whatever the kernel.
    assert not grouped_supported(torch.randn(8, 12), torch.randn(2, 8, 12), torch.bfloat16)


@pytest.mark.parametrize("impl", ["auto", "grouped"])
def test_under_bf16_autocast_the_result_is_bf16_and_matches_the_loop(impl):
    fallbacks.clear()
    counts = torch.tensor([3, 0, 5])
    x0, w0 = torch.randn(8, 16), torch.randn(3, 8, 16) * 0.1
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm(x, w, counts, impl=impl)
        want = grouped_mm_loop(x0, w0, counts)  # F.linear under autocast: bf16 inputs, bf16 out
    out.float().sum().backward()
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()
    # The loop ran here (no CPU bf16 kernel): recorded only when grouped GEMM was asked for by name.
    took_loop = not _cpu_bf16_grouped()
    keys = [f.key for f in fallbacks.recorded()]
    assert keys == (["ops.grouped_mm"] if took_loop and impl == "grouped" else [])
    if keys:
        assert "moe_impl" in fallbacks.recorded()[0].asked
    fallbacks.clear()


def test_explicit_grouped_on_unaligned_widths_falls_back_with_a_record():
    fallbacks.clear()
    x, w, counts = torch.randn(5, 3), torch.randn(2, 4, 3), torch.tensor([2, 3])  # 12-byte fp32 rows
    torch.testing.assert_close(grouped_mm(x, w, counts, impl="grouped"), grouped_mm_loop(x, w, counts))
    [entry] = fallbacks.recorded()
    assert entry.key == "ops.grouped_mm" and "16-byte" in entry.why
    fallbacks.clear()
    grouped_mm(x, w, counts, impl="auto")
    assert fallbacks.recorded() == []
