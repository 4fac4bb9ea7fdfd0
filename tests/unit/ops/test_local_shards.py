"""The fused ops' DTensor handling (forja/ops/dispatch.py, `local_shards` and `as_output`): on
2 Gloo ranks, running an op on each rank's local shard and wrapping the result back gives the
values and gradients of the same op run through DTensor's own rules, and layouts a row-wise op
cannot take are refused. The op here is the PyTorch reference (the plumbing is under test; the
kernels on shards run in tests/distributed/test_fused_sp.py)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from forja.ops.dispatch import as_output, local_shards
from forja.ops.rms_norm import rms_norm_reference
from forja.ops.swiglu import swiglu_reference
from forja.testing import run_distributed


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.full_tensor() - b.full_tensor()).abs().max())


def _rms_norm_both_ways(mesh, placements):
    torch.manual_seed(0)
    x_full, w_full = torch.randn(2, 6, 8), 1 + 0.1 * torch.randn(8)
    runs = []
    for local in (False, True):
        x = distribute_tensor(x_full, mesh, placements).requires_grad_()
        w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Replicate()]))
        if local:
            (x_local, w_local), like = local_shards((x, w), keep_dims=(-1,))
            y = as_output(rms_norm_reference(x_local, w_local, 1e-5), like)
        else:
            y = rms_norm_reference(x, w, 1e-5)
        columns = distribute_tensor(torch.arange(8.0), mesh, [Replicate()])
        (y * columns).sum().backward()  # a gradient that differs per column
        runs.append((y, x.grad, w.grad))
    return [_max_diff(a, b) for a, b in zip(*runs)], str(runs[1][0].placements)


def _checks(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {"seq": _rms_norm_both_ways(mesh, [Shard(1)]), "replicated": _rms_norm_both_ways(mesh, [Replicate()])}
    torch.manual_seed(1)
    g_full, u_full = torch.randn(4, 6), torch.randn(4, 6)
    g = distribute_tensor(g_full, mesh, [Shard(0)]).requires_grad_()
    u = distribute_tensor(u_full, mesh, [Shard(0)]).requires_grad_()
    (g_local, u_local), like = local_shards((g, u), keep_dims=())
    as_output(swiglu_reference(g_local, u_local), like).sum().backward()
    out["swiglu"] = [float((g.grad.full_tensor() - torch.func.grad(
        lambda a: swiglu_reference(a, u_full).sum())(g_full)).abs().max())]
    x = distribute_tensor(torch.randn(2, 6, 8), mesh, [Shard(2)])
    w = distribute_tensor(torch.ones(8), mesh, [Replicate()])
    partial = DTensor.from_local(torch.randn(2, 6, 8), mesh, [Partial()])
    out["refused"] = [local_shards((x, w), keep_dims=(-1,)) is None,  # the normalized dimension split
                      local_shards((partial, w), keep_dims=(-1,)) is None,  # partial sums
                      local_shards((g, u.redistribute(mesh, [Replicate()])), keep_dims=()) is None]  # unlike
    return out


def test_local_shards_give_the_dtensor_values_and_gradients():
    for result in run_distributed(_checks, 2):
        for layout in ("seq", "replicated"):
            diffs, placements = result[layout]
            assert max(diffs) < 1e-6, (layout, diffs)  # y, d x, d weight
        assert result["seq"][1] == "(Shard(dim=1),)"
        assert result["swiglu"][0] < 1e-6
        assert result["refused"] == [True, True, True]
