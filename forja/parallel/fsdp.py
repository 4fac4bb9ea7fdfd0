"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`).

Each transformer block is one FSDP unit (its parameters gathered just before it runs
and freed after), and the root holds the rest: embeddings, final norm, output. With
`dp_replicate > 1` as well, the mesh is 2-D and FSDP shards within a group and
replicates across groups (HSDP).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from forja.parallel.dims import ParallelDims


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, *, reshard_after_forward: bool = True) -> None:
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # The root's parameters are needed again at once by backward: keep them gathered.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
