"""Expert parallelism at the layer: an MoE layer whose experts are split over 2 Gloo ranks
computes what one process computes on both ranks' tokens, forward and backward."""

from __future__ import annotations

import pytest
import torch

from forja.models.common.moe import MoE, MoEArgs
from forja.testing import run_distributed

DIM = 16


def _layer(**kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(**{"n_experts": 4, "top_k": 2, "moe_ffn_dim": 8, **kw}))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _tokens(rank: int, n: int) -> torch.Tensor:
    return torch.randn(1, n, DIM, generator=torch.Generator().manual_seed(100 + rank))


def _ep_case(rank: int, world: int, kw: dict, sizes: list[int]):
    from torch.distributed.tensor import DTensor

    from forja.parallel.dims import ParallelDims
    from forja.parallel.ep import apply_ep

    dims = ParallelDims(1, 1, world, 1, 1, ep=world)
    dims.build_mesh("cpu")
    moe = _layer(**kw)
    apply_ep(moe, dims.ep_mesh)
    assert isinstance(moe.experts.w1, DTensor) and moe.experts.w1.to_local().shape[0] == 4 // world
    x = _tokens(rank, sizes[rank]).requires_grad_()
    out = moe(x)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("kw, sizes", [
    (dict(), [6, 6]),
    (dict(score_func="sigmoid", expert_bias=True, n_shared_experts=1, aux_loss_weight=0.1), [5, 9]),
    (dict(capacity_factor=0.5), [8, 8]),
    (dict(), [1, 7]),  # few tokens: some experts receive none from a rank
])
def test_ep2_layer_matches_one_process(kw, sizes):
    results = run_distributed(_ep_case, 2, kw, sizes)
    moe = _layer(**kw)
    for rank, (out, x_grad, grads) in enumerate(results):
        x = _tokens(rank, sizes[rank]).requires_grad_()
        ref = moe(x)
        (ref * torch.arange(ref.numel()).view_as(ref).sin()).sum().backward()
        torch.testing.assert_close(out, ref.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(x_grad, x.grad, atol=1e-6, rtol=1e-5)
    # Routed experts: each rank holds half, with the gradient of both ranks' tokens.
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        full = torch.cat([grads[name] for _, _, grads in results])
        torch.testing.assert_close(full, dict(moe.named_parameters())[name].grad, atol=1e-5, rtol=1e-5)
    # Everything else is data-parallel: the ranks' gradients add up to one process's.
    for name, p in moe.named_parameters():
        if not name.startswith("experts."):
            total = sum(grads[name] for _, _, grads in results)
            torch.testing.assert_close(total, p.grad, atol=1e-5, rtol=1e-5)
