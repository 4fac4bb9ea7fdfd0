"""On CUDA: the fused ops take DTensor shards (a one-GPU mesh, the sequence split as under
sequence parallelism) with their kernels, and each promised kernel not run is recorded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from forja import fallbacks
from forja.ops import rms_norm, swiglu
from forja.ops.rms_norm import rms_norm_reference
from forja.testing import free_port

pytest.importorskip("triton")


@pytest.fixture
def mesh(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    fallbacks.clear()
    yield init_device_mesh("cuda", (1,))
    fallbacks.clear()
    dist.destroy_process_group()


def test_rms_norm_and_swiglu_run_their_kernels_on_dtensor_shards(mesh):
    x = distribute_tensor(torch.randn(2, 8, 64, device="cuda"), mesh, [Shard(1)]).requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(torch.ones(64, device="cuda"), mesh, [Replicate()]))
    y = rms_norm(x, w, 1e-5)
    # The output wraps the kernel's: DTensor.from_local's backward feeds the fused Function's.
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions] == ["_RMSNormFunctionBackward"]
    assert float((y.full_tensor() - rms_norm_reference(x.full_tensor(), w.full_tensor(), 1e-5)).abs().max()) < 1e-5
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    g = distribute_tensor(torch.randn(2, 8, 64, device="cuda"), mesh, [Shard(1)])
    swiglu(g, g)
    assert fallbacks.recorded() == []


def test_forced_reference_on_cuda_is_recorded(mesh, monkeypatch):
    monkeypatch.setenv("FORJA_OPS", "reference")
    rms_norm(torch.randn(4, 64, device="cuda"), torch.ones(64, device="cuda"))
    [entry] = fallbacks.recorded()
    assert entry.key == "ops.rms_norm" and entry.why == "FORJA_OPS=reference forces it"
