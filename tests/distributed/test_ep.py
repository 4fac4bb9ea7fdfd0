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


def _ep_case(rank: int, world: int, ep_mesh, kw: dict, sizes: list[int]):
    from torch.distributed.tensor import DTensor

    from forja.parallel.ep import apply_ep

    moe = _layer(**kw)
    apply_ep(moe, ep_mesh)
    assert isinstance(moe.experts.w1, DTensor) and moe.experts.w1.to_local().shape[0] == 4 // world
    x = _tokens(rank, sizes[rank]).requires_grad_()
    out = moe(x)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


def _ep_cases(rank: int, world: int, cases: list[tuple[dict, list[int]]]) -> list:
    """Every case on one mesh: one spawn for all of them (the start-up is most of the time)."""
    from forja.parallel.degrees import Degrees
    from forja.parallel.dims import ParallelDims

    dims = ParallelDims(Degrees(dp_shard=world, ep=world))
    dims.build_mesh("cpu")
    return [_ep_case(rank, world, dims.ep_mesh, kw, sizes) for kw, sizes in cases]


CASES = [
    (dict(), [6, 6]),
    (dict(score_func="sigmoid", expert_bias=True, n_shared_experts=1, aux_loss_weight=0.1), [5, 9]),
    (dict(capacity_factor=0.5), [8, 8]),
    (dict(), [1, 7]),  # few tokens: some experts receive none from a rank
]


@pytest.fixture(scope="module")
def ep_results() -> list[list]:
    """rank -> case -> (output, input gradient, parameter gradients), all cases in one spawn."""
    return run_distributed(_ep_cases, 2, CASES)


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=["top-2", "sigmoid, bias, shared expert", "capacity 0.5", "few tokens"])
def test_ep2_layer_matches_one_process(case, ep_results):
    kw, sizes = CASES[case]
    results = [of_rank[case] for of_rank in ep_results]
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


def _wait_seen(rank: int, world: int, flag: str):
    """Rank 0 enters an exchange while rank 1 holds back until a thread of rank 0's has read
    the collective the hang watchdog would report it waiting in (None after 20 s)."""
    import os
    import sys
    import threading
    import time

    import torch.distributed as dist

    from forja.parallel.ep import all_to_all
    from forja.train.resilience.watchdog import locate

    seen = []
    if rank == 0:
        main = threading.get_ident()

        def sample() -> None:
            deadline = time.monotonic() + 20
            while not seen and time.monotonic() < deadline:
                collective = locate(sys._current_frames().get(main))[0]
                seen.extend([collective] if collective is not None else [])
                time.sleep(0.005)
            open(flag, "w").close()

        threading.Thread(target=sample, daemon=True).start()
    else:
        while not os.path.exists(flag):
            time.sleep(0.01)
    all_to_all(torch.ones(4, DIM), [2, 2], [2, 2], dist.group.WORLD, kept=True)
    return seen


def test_a_rank_waiting_in_an_exchange_is_seen_in_a_collective(tmp_path):
    """EP's exchanges are functional collectives: a rank blocked in one still shows the hang
    watchdog a torch.distributed frame (forja/train/resilience/watchdog.py), not 'not in a collective'."""
    assert run_distributed(_wait_seen, 2, str(tmp_path / "sampled"))[0] == ["wait_tensor"]
