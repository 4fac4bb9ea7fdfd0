"""forja's Triton kernels (rms_norm, rope, swiglu) on a real GPU against the PyTorch
references, forward and backward, at Llama 3.2-1B sizes (skipped without CUDA).

Tolerances, as the largest error over the largest reference value: float32 1e-5, bfloat16
1e-2 with at least 90% of elements equal to the bit (the kernels round where eager rounds;
the GPU's exp/rsqrt approximations and fused multiply-adds move a few across a rounding
boundary). Under the CPU interpreter the same checks reach 100% (tests/unit/ops).
"""

from __future__ import annotations

import pytest
import torch

from forja.ops import rms_norm, rope, swiglu, use_triton
from forja.ops.rms_norm import rms_norm_reference
from forja.ops.rope import rope_reference
from forja.ops.swiglu import swiglu_reference

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def default_dispatch(monkeypatch):
    monkeypatch.delenv("FORJA_OPS", raising=False)


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    low_precision = got.dtype != torch.float32
    got, want = got.float(), want.float()
    rel = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert rel <= (1e-2 if low_precision else 1e-5), (what, rel)
    if low_precision:
        assert float((got == want).float().mean()) >= 0.9, what


def _both(fused, reference, inputs, grad_outs):
    out = fused(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    assert all("Function" in type(o.grad_fn).__name__ for o in out), "the Triton path did not run"
    dys = grad_outs(out)
    grads = torch.autograd.grad(out, inputs, dys)
    ref = reference(*inputs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    ref_grads = torch.autograd.grad(ref, inputs, dys)
    return list(zip(out + grads, ref + ref_grads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [2048, 96, 16384])
def test_rms_norm(dtype, dim):
    torch.manual_seed(0)
    rows = 8192 if dim == 2048 else 64
    x = torch.randn(rows, dim, device=CUDA, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(dim, device=CUDA)).to(dtype).requires_grad_()
    assert use_triton(x, w)
    pairs = _both(lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5), (x, w),
                  lambda out: [torch.randn_like(o) for o in out])
    for name, (got, want) in zip(("y", "dx", "dweight"), pairs):
        _check(got, want, f"rms_norm {name} D={dim} {dtype}")


def test_rms_norm_weight_gradient_is_deterministic():
    x = torch.randn(4096, 2048, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(2048, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4096, 2048, device=CUDA, dtype=torch.bfloat16)
    first = torch.autograd.grad(rms_norm(x, w, 1e-5), w, dy)[0]
    second = torch.autograd.grad(rms_norm(x, w, 1e-5), w, dy)[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_llama_1b(dtype):
    torch.manual_seed(0)
    B, T, H, Hkv, hd = 2, 4096, 32, 8, 64
    # q as the attention makes it: a view of a linear output; k strided (a transposed copy).
    q = torch.randn(B, T, H * hd, device=CUDA, dtype=dtype).view(B, T, H, hd).requires_grad_()
    k = torch.randn(B, Hkv, T, hd, device=CUDA, dtype=dtype).transpose(1, 2).requires_grad_()
    angles = torch.arange(T, device=CUDA).float()[:, None] * (1e-4 ** torch.linspace(0, 1, hd // 2, device=CUDA))
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos(), angles.sin()
    pairs = _both(lambda a, b: rope(a, b, cos, sin), lambda a, b: rope_reference(a, b, cos, sin), (q, k),
                  lambda out: [torch.randn_like(o) for o in out])
    for name, (got, want) in zip(("q", "k", "dq", "dk"), pairs):
        _check(got, want, f"rope {name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_llama_1b(dtype):
    torch.manual_seed(0)
    gate = (torch.randn(8192, 8192, device=CUDA) * 4).to(dtype).requires_grad_()
    up = torch.randn(8192, 8192, device=CUDA, dtype=dtype, requires_grad=True)
    pairs = _both(swiglu, swiglu_reference, (gate, up), lambda out: [torch.randn_like(o) for o in out])
    for name, (got, want) in zip(("y", "dgate", "dup"), pairs):
        _check(got, want, f"swiglu {name} {dtype}")


def test_fused_ops_compile_into_one_graph():
    # The model compiles its blocks with the fused ops in them: the kernels must trace.
    def block(x, w, q, k, cos, sin, gate, up):
        qo, ko = rope(q, k, cos, sin)
        return rms_norm(x, w, 1e-5).sum() + qo.sum() + ko.sum() + swiglu(gate, up).sum()

    torch.manual_seed(0)
    args = [torch.randn(64, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True),
            torch.ones(256, device=CUDA, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(2, 16, 4, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(2, 16, 2, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA),
            torch.randn(64, 512, device=CUDA, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(64, 512, device=CUDA, dtype=torch.bfloat16, requires_grad=True)]
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    trainable = [a for a in args if a.requires_grad]
    got = torch.autograd.grad(compiled(*args), trainable)
    want = torch.autograd.grad(block(*args), trainable)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
