"""The grouped matmul of a mixture of experts: torch._grouped_mm against the per-group loop."""

from __future__ import annotations

import pytest
import torch

from forja import fallbacks
from forja.ops.grouped_mm import (
    compute_dtype,
    grouped_mm,
    grouped_mm_fused,
    grouped_mm_loop,
    grouped_supported,
    pad_groups,
    padded_groups,
    row_alignment,
    unpad_groups,
)


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


UNALIGNED = [[3, 0, 13, 5], [0, 0, 0, 0], [0, 9, 0, 7], [16, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 21]]


@pytest.mark.parametrize("align", [8, 16])
@pytest.mark.parametrize("counts", UNALIGNED)
def test_padded_groups_start_at_multiples_and_keep_every_row(counts, align):
    rows, G = sum(counts), len(counts)
    index, ends, padded_rows = padded_groups(torch.tensor(counts), rows, align)
    assert index.dtype == torch.int64 and ends.dtype == torch.int32 and padded_rows == rows + G * (align - 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends[:-1]])  # (G,)
    lengths = ends - starts
    assert (starts % align == 0).all() and (ends % align == 0).all()
    assert ((lengths >= torch.tensor(counts)) & (lengths < torch.tensor(counts) + align)).all()
    assert int(ends[-1]) <= padded_rows
    # each real row sits, in order, at the head of its own group's padded range
    real_start = 0
    for g, n in enumerate(counts):
        want = torch.arange(n) + int(starts[g])
        torch.testing.assert_close(index[real_start:real_start + n], want)
        real_start += n
    assert index.unique().numel() == rows


def test_padded_groups_of_the_example():
    index, ends, padded_rows = padded_groups(torch.tensor([3, 0, 13, 5]), 21, 8)
    assert ends.tolist() == [8, 8, 24, 32] and padded_rows == 21 + 4 * 7
    assert index.tolist() == [0, 1, 2, *range(8, 21), *range(24, 29)]


@pytest.mark.parametrize("counts", UNALIGNED)
def test_pad_loop_unpad_equals_the_loop_forward_and_backward(counts):
    """The padded round trip through the reference: same output, same gradients; pad rows
    are zero going in and coming out."""
    torch.manual_seed(0)
    x0, w0 = torch.randn(sum(counts), 32), torch.randn(len(counts), 16, 32)
    weights = torch.linspace(-1, 1, sum(counts) * 16).view(sum(counts), 16)
    index, ends, padded_rows = padded_groups(torch.tensor(counts), x0.shape[0], 8)
    padded_counts = ends.diff(prepend=torch.zeros(1, dtype=torch.int32))  # (G,)
    results = []
    for padded in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if padded:
            xp = pad_groups(x, index, padded_rows)  # (P, 32)
            real = torch.zeros(padded_rows, dtype=torch.bool).index_fill(0, index, True)
            assert (xp[~real] == 0).all()
            yp = grouped_mm_loop(xp[: int(ends[-1])], w, padded_counts)  # (ends[-1], 16)
            assert (yp[~real[: int(ends[-1])]] == 0).all()
            out = unpad_groups(yp, index)
        else:
            out = grouped_mm_loop(x, w, torch.tensor(counts))
        (out * weights).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("counts", UNALIGNED)
def test_padded_fused_equals_the_loop_forward_and_backward(counts):
    """torch._grouped_mm itself on the padded rows (its CPU kernel, fp32): the offsets it is
    given are the padded ends, rows past the last end are left to the kernel."""
    x0, w0 = torch.randn(sum(counts), 32), torch.randn(len(counts), 16, 32)
    if not grouped_supported(x0, w0):
        pytest.skip(f"torch {torch.__version__} has no CPU torch._grouped_mm")
    results = []
    for fn in (lambda x, w, c: grouped_mm_fused(x, w, c, align=8), grouped_mm_loop):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w, torch.tensor(counts))
        out.sum().backward()  # a zero-stride gradient, as _ContiguousGrad expects
        results.append((out.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rows_are_padded_on_cuda_only():
    assert row_alignment(torch.empty(2, 8)) == row_alignment(torch.empty(2, 8, dtype=torch.bfloat16)) == 1


def test_the_first_call_under_selective_checkpointing_keeps_its_matmuls_in_order():
    """Op-level selective AC keeps each `_grouped_mm` output and hands them back in order on
    recomputation: the kernel probe of a process's first call must not be one of them."""
    from forja.models.common.moe import MoE, MoEArgs
    from forja.ops import grouped_mm as module
    from forja.parallel.ac import CheckpointedBlock

    torch.manual_seed(0)
    moe = MoE(16, MoEArgs(n_experts=4, top_k=2, moe_ffn_dim=8))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(1, 12, 16, requires_grad=True)
    module._grouped_supported.cache_clear()  # this call is the process's first: it probes
    CheckpointedBlock(moe, op_level=True)(x).sum().backward()
    checkpointed, x.grad = x.grad, None
    moe(x).sum().backward()
    torch.testing.assert_close(checkpointed, x.grad, rtol=0, atol=0)
