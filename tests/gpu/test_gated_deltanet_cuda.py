"""flash-linear-attention's chunked gated delta rule against forja's PyTorch reference on a
real GPU, forward and backward, with an initial state and with packed documents (skipped
without CUDA or without fla).

Tolerances, as the largest error over the largest reference value, the reference in fp32 from
the same (rounded) inputs: float32 5e-3 (fla's Triton dots may run in TF32), bfloat16 3e-2 for
outputs and states and 6e-2 for gradients (fla keeps bf16 intermediates between kernels).
"""

from __future__ import annotations

import pytest
import torch

from forja import fallbacks
from forja.models.common import gated_delta_rule as gdr

CUDA = torch.device("cuda")
B, T, HK, HV, DK, DV = 2, 200, 2, 4, 64, 64  # T not a multiple of fla's chunk (64)


def _kernel():
    pytest.importorskip("fla")
    kernel = gdr.optional_kernel("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    if kernel is None:
        pytest.skip("fla is importable but has no fla.ops.gated_delta_rule")
    return kernel


def _inputs(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    q, k = (torch.randn(B, T, HK, DK, device=CUDA, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, DV, device=CUDA, generator=gen)
    g = -torch.rand(B, T, HV, device=CUDA, generator=gen)  # log decay in (-1, 0]
    beta = torch.rand(B, T, HV, device=CUDA, generator=gen)
    h0 = torch.randn(B, HV, DK, DV, device=CUDA, generator=gen)
    # Inputs in `dtype` as the mixer hands them over (g stays fp32, as the mixer computes it).
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), h0]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _run(fn, inputs, document_ids):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, document_ids=document_ids)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    do, dS = torch.randn(o.shape, device=CUDA, generator=gen), torch.randn(S.shape, device=CUDA, generator=gen)
    grads = torch.autograd.grad((o.float() * do).sum() + (S.float() * dS).sum(), leaves)
    return o, S, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_fla_matches_the_reference(dtype, packed):
    kernel = _kernel()
    inputs = _inputs(dtype)
    docs = None
    if packed:  # row 0: three documents (one shorter than a chunk); row 1: one
        docs = torch.tensor([[0] * 50 + [1] * 30 + [2] * 120, [3] * 200], device=CUDA)

    def fla(*args, **kw):
        return gdr.fla_gated_delta_rule(kernel, *args, **kw)

    try:
        o, S, grads = _run(fla, inputs, docs)
    except AssertionError as e:  # older fla releases refuse float32 inputs
        if dtype == torch.float32:
            pytest.skip(f"this fla release refuses float32: {e}")
        raise
    ref_inputs = [t.float() for t in inputs]
    o_ref, S_ref, grads_ref = _run(gdr.chunk_gated_delta_rule, ref_inputs, docs)
    assert o.dtype == dtype and o.shape == (B, T, HV, DV) and S.shape == (B, HV, DK, DV)
    tol = 5e-3 if dtype == torch.float32 else 3e-2
    assert _rel(o, o_ref) <= tol and _rel(S, S_ref) <= tol
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    for name, got, want in zip(names, grads, grads_ref):
        assert _rel(got, want) <= (tol if dtype == torch.float32 else 6e-2), name


def test_the_dispatch_takes_fla_on_cuda():
    kernel = _kernel()
    inputs = _inputs(torch.bfloat16)
    fallbacks.clear()
    o, _ = gdr.gated_delta_rule(*inputs[:5])
    o_fla, _ = gdr.fla_gated_delta_rule(kernel, *inputs[:5])
    assert torch.equal(o, o_fla)
    assert "gated_deltanet.fla" not in {f.key for f in fallbacks.recorded()}


def test_without_fla_the_reference_runs_and_is_recorded(monkeypatch):
    monkeypatch.setitem(gdr._KERNELS, ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), None)
    fallbacks.clear()
    inputs = _inputs(torch.float32)
    o, S = gdr.gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    o_ref, S_ref = gdr.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
    assert "gated_deltanet.fla" in {f.key for f in fallbacks.recorded()}
    fallbacks.clear()
