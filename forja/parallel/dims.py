"""Parallel degrees -> a validated `DeviceMesh`.

The mesh always has the same five named dimensions, outermost first:
("pp", "dp_replicate", "dp_shard", "cp", "tp"); degrees of 1 are kept, so code can
ask for `mesh["tp"]` whatever the layout. Tensor parallelism is innermost so its
heavy, latency-bound collectives stay within a node; pipeline stages outermost.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forja.errors import ForjaError
from forja.parallel.config import ParallelConfig
from forja.parallel.process_group import apply_timeout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        others = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ForjaError(f"world size {world_size} is not divisible by dp_replicate*tp*pp*cp = {others}; "
                                 "change the parallel degrees or the number of processes")
            dp_shard = world_size // others
        dims = cls(cfg.pp, cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp)
        if dims.world_size != world_size:
            raise ForjaError(f"parallel degrees multiply to {dims.world_size} "
                             f"(pp={dims.pp} x dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} x "
                             f"cp={dims.cp} x tp={dims.tp}) but {world_size} processes run; make them equal "
                             "(parallel.dp_shard = -1 fills the rest)")
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        apply_timeout(mesh)  # torch gives a mesh's sub-groups its default timeout, not parallel.timeout_s
        return mesh


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel replicas (replicate-major)."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()
