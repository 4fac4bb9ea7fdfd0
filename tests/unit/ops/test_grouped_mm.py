"""The grouped matmul of a mixture of experts: torch._grouped_mm against the per-group loop."""

from __future__ import annotations

import pytest
import torch

from forja.ops.grouped_mm import grouped_mm, grouped_mm_fused, grouped_mm_loop, grouped_supported


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
