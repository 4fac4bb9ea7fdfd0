"""A model that mixes DTensor and plain parameters (tensor parallelism without FSDP: sharded
matrices beside whole norm weights) steps: torch's multi-tensor AdamW refuses such a group
(`aten._foreach_mul_` given Tensor and DTensor), so forja steps it with the for-loop kernel
and says so in the fallback record."""

from __future__ import annotations

import torch

from forja.testing import run_distributed


def _step_mixed(rank: int, world: int) -> tuple[list[str], float]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from forja import fallbacks
    from forja.optim.config import OptimConfig
    from forja.optim.optimizers import build_optimizer

    fallbacks.clear()
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))  # (4, 4) sharded
    model.g = nn.Parameter(torch.ones(4))  # a plain vector beside it
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=0.1, implementation="foreach"))
    (model.w.full_tensor().sum() + model.g.sum()).backward()
    opt.step()
    return [f.key for f in fallbacks.recorded()], float(model.g.detach()[0])


def test_mixed_dtensor_and_plain_parameters_step_with_the_for_loop_kernel():
    keys, g = run_distributed(_step_mixed, 2)[0]
    assert keys == ["optim.implementation"]
    assert g < 1.0  # the plain parameter moved: the step ran
