"""The references of forja.ops equal forja's modules exactly, and the dispatch between
reference and kernel: on CPU, turning the fused ops on changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import forja.ops
from forja.errors import ForjaError
from forja.models.common.mlp import SwiGLU
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import apply_rope, rope_cos_sin, rope_frequencies
from forja.ops import FUSED_OPS, rms_norm, rope, swiglu, use_triton
from forja.ops.dispatch import row_block

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def default_dispatch(monkeypatch):
    monkeypatch.delenv("FORJA_OPS", raising=False)


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_the_module(dtype):
    torch.manual_seed(0)
    module = RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(96))
    x = torch.randn(2, 5, 96, dtype=dtype, requires_grad=True)
    y_module, y_op = module(x), rms_norm(x, module.weight, 1e-6)
    assert y_op.dtype == y_module.dtype == dtype
    assert torch.equal(y_op, y_module)
    dy = torch.randn_like(y_op)
    for a, b in zip(_grads(y_op, (x, module.weight), dy), _grads(y_module, (x, module.weight), dy)):
        assert torch.equal(a, b)


def test_rms_norm_result_dtype_is_promoted():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert rms_norm(x, torch.ones(16), 1e-5).dtype == torch.float32
    assert rms_norm(x.float(), torch.ones(16, dtype=torch.bfloat16), 1e-5).dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_equals_apply_rope_on_q_and_k(dtype):
    torch.manual_seed(0)
    B, T, H, Hkv, hd = 2, 6, 4, 2, 32
    cos, sin = rope_cos_sin(rope_frequencies(hd, 10000.0), torch.arange(T))
    q = torch.randn(B, T, H, hd, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, Hkv, hd, dtype=dtype, requires_grad=True)
    qo, ko = rope(q, k, cos, sin)
    qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    for a, b in zip(_grads((qo, ko), (q, k), (dq, dk)), _grads((qr, kr), (q, k), (dq, dk))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_equals_silu_times_up(dtype):
    torch.manual_seed(0)
    gate = (torch.randn(3, 40) * 4).to(dtype).requires_grad_()
    up = torch.randn(3, 40, dtype=dtype, requires_grad=True)
    y, y_ref = swiglu(gate, up), F.silu(gate) * up
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    for a, b in zip(_grads(y, (gate, up), dy), _grads(y_ref, (gate, up), dy)):
        assert torch.equal(a, b)


def test_fused_modules_equal_unfused_ones_on_cpu():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24)
    norm, fused_norm = RMSNorm(24), RMSNorm(24, fused=True)
    mlp, fused_mlp = SwiGLU(24, 40), SwiGLU(24, 40, fused=True)
    torch.nn.init.normal_(norm.weight)
    fused_norm.load_state_dict(norm.state_dict())
    fused_mlp.load_state_dict(mlp.state_dict())
    assert torch.equal(fused_norm(x), norm(x))
    assert torch.equal(fused_mlp(x), mlp(x))


def test_reference_runs_on_cpu_and_the_override_is_read(monkeypatch):
    cpu = torch.ones(4)
    assert use_triton(cpu) is False
    monkeypatch.setenv("FORJA_OPS", "reference")
    assert use_triton(cpu) is False
    # Forcing Triton on CPU tensors outside the interpreter is refused with the fix named
    # (test_kernels.py checks that it flips to True under TRITON_INTERPRET=1).
    monkeypatch.setenv("FORJA_OPS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ForjaError, match="TRITON_INTERPRET=1"):
        use_triton(cpu)
    monkeypatch.setenv("FORJA_OPS", "fast")
    with pytest.raises(ForjaError, match="FORJA_OPS='fast'"):
        use_triton(cpu)


def test_bad_shapes_are_named():
    with pytest.raises(ForjaError, match=r"must be \(8,\)"):
        rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ForjaError, match="same shape"):
        swiglu(torch.ones(2, 8), torch.ones(2, 4))
    q, k = torch.ones(1, 3, 2, 8), torch.ones(1, 3, 1, 8)
    with pytest.raises(ForjaError, match=r"must be \(3, 8\)"):
        rope(q, k, torch.ones(4, 8), torch.ones(4, 8))
    with pytest.raises(ForjaError, match="65536"):
        row_block(65537, "rms_norm")


def test_row_blocks_cover_the_row():
    for n in (1, 64, 96, 2048, 16384, 65536):
        block, warps = row_block(n, "rms_norm")
        assert block >= n and block & (block - 1) == 0 and block < 2 * max(n, 1) + 1
        assert warps in (4, 8, 16, 32)


def test_public_names():
    assert FUSED_OPS == ("rms_norm", "rope", "swiglu", "cross_entropy")
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"} <= set(forja.ops.__all__)
    with pytest.raises(AttributeError):
        forja.ops.no_such_op  # noqa: B018


def test_dispatch_traces_into_one_graph():
    # Models compile their blocks with the fused ops on: the dispatch must not break the graph.
    def f(x, w, q, k, cos, sin, gate, up):
        qo, ko = rope(q, k, cos, sin)
        return rms_norm(x, w, 1e-5).sum() + qo.sum() + ko.sum() + swiglu(gate, up).sum()

    args = (torch.randn(2, 8), torch.ones(8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8),
            torch.randn(3, 8), torch.randn(3, 8), torch.randn(5), torch.randn(5))
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(*args), f(*args))
