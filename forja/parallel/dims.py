"""Parallel degrees -> a validated `DeviceMesh`, and every group derived from it.

The mesh always has the same five named dimensions, outermost first (`MESH_AXES`,
forja/parallel/degrees.py): ("pp", "dp_replicate", "dp_shard", "cp", "tp"); degrees of 1
are kept, so code can ask for `mesh["tp"]` whatever the layout. Tensor parallelism is
innermost so its heavy, latency-bound collectives stay within a node; pipeline stages outermost.

Every other mesh or process group forja uses (FSDP's, the loss average's, the
pipeline's, the tied embedding's, a CPU group for stop flags) is made here, once, in
`build_mesh`, in the same order on every rank: creating a group is a collective call, and
ranks that create them in different orders deadlock. (The tied embedding's pairs are the
exception: disjoint, each made by its two ranks alone.) Each gets the run's timeout.

Expert parallelism borrows from data parallelism: with parallel.ep > 1, a second mesh over
the same ranks, ("pp", "dp_replicate", "efsdp", "cp", "ep", "tp"), splits dp_shard into
efsdp x ep (consecutive dp_shard ranks form an EP group). Routed experts are sharded over
"ep" and FSDP-sharded over "efsdp" (and replicated over dp_replicate); everything else
keeps the main mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from forja.parallel.config import ParallelConfig
from forja.parallel.degrees import MESH_AXES, Axis, Degrees, WithDegrees
from forja.parallel.process_group import apply_timeout, new_group, set_group_timeout

# The expert mesh's own dimension: the dp_shard ranks that hold the same experts.
EFSDP = "efsdp"
# The expert mesh: the world mesh with dp_shard split into (efsdp, ep) and ep moved next to tp.
# (Mesh dimension names are given to torch as plain strings; an Axis looks them up as its key.)
EXPERT_MESH_DIMS = (Axis.PP.value, Axis.DP_REPLICATE.value, EFSDP, Axis.CP.value, Axis.EP.value, Axis.TP.value)


@dataclass
class ParallelDims(WithDegrees):
    """A run's resolved degrees (`dims.tp`, `dims.dp`, ... read them) and, once `build_mesh`
    ran, its mesh and every group derived from it."""

    degrees: Degrees
    """Resolved against the world size (no dp_shard = -1)."""
    cp_kind: str = "ring"
    """How a cp group mixes its rows (ParallelConfig.cp_kind)."""
    _groups: _Groups | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """The `[parallel]` section's degrees on `world_size` ranks (ForjaError if they cannot be)."""
        return cls(cfg.degrees.resolve(world_size), cp_kind=cfg.cp_kind)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh, and every group derived from it (collective: all ranks call it)."""
        shape = tuple(degree for _, degree in self.degrees.items(MESH_AXES))
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(axis.value for axis in MESH_AXES))
        apply_timeout(mesh)  # torch gives a mesh's sub-groups its default timeout, not parallel.timeout_s
        self._groups = _Groups.build(self, mesh)
        return mesh

    @property
    def groups(self) -> _Groups:
        if self._groups is None:
            raise RuntimeError("ParallelDims.build_mesh() must run before its groups are used")
        return self._groups

    # -- what the rest of forja asks for ---------------------------------------------------
    @property
    def mesh(self) -> DeviceMesh:
        return self.groups.mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[Axis.TP]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The ranks that split one sequence; None without context parallelism."""
        return self.mesh[Axis.CP] if self.cp > 1 else None

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh[Axis.PP]

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the stages of one model copy; None without pipeline parallelism."""
        return self.pp_mesh.get_group() if self.pp > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: dp_shard, joined with cp when the sequence is split
        (each cp rank holds a shard too); 2-D with dp_replicate for HSDP."""
        return self.groups.fsdp_mesh

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks whose losses are averaged into the step's: those that see different
        data or different parts of it (dp_replicate x dp_shard x cp). None: every rank."""
        return self.groups.loss_group

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        """A Gloo group over all ranks, for small CPU-side agreements (stop flags)."""
        return self.groups.cpu_group

    @property
    def pp_ends_group(self) -> dist.ProcessGroup | None:
        """This rank and its counterpart at the other end of the pipeline (pp ranks 0 and
        pp - 1, same data/tensor coordinates): where a tied embedding's two copies live.
        None without pipeline parallelism, and on the middle stages."""
        return self.groups.pp_ends_group

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The ranks sharing one MoE layer's experts; None without expert parallelism."""
        return self.groups.expert_mesh[Axis.EP] if self.ep > 1 else None

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """What FSDP shards routed experts over under EP: the data-parallel ranks holding the
        same experts (efsdp, joined with cp when the rows are split: those ranks see other
        tokens too), 2-D with dp_replicate for HSDP; None without EP."""
        if self.ep == 1:
            return None
        mesh = self.groups.expert_mesh
        shard = "efsdp_cp" if self.cp > 1 else EFSDP
        return mesh[Axis.DP_REPLICATE, shard] if self.dp_replicate > 1 else mesh[shard]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (replicate-major)."""
        mesh = self.mesh
        return mesh[Axis.DP_REPLICATE].get_local_rank() * self.dp_shard + mesh[Axis.DP_SHARD].get_local_rank()


@dataclass
class _Groups:
    mesh: DeviceMesh
    fsdp_mesh: DeviceMesh
    loss_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup
    pp_ends_group: dist.ProcessGroup | None
    expert_mesh: DeviceMesh | None

    @classmethod
    def build(cls, dims: ParallelDims, mesh: DeviceMesh) -> _Groups:
        # The order below is the order of collective group creation on every rank.
        return cls(mesh=mesh, fsdp_mesh=_fsdp_mesh(dims, mesh), loss_group=_loss_group(dims, mesh),
                   cpu_group=new_group(backend="gloo"), pp_ends_group=_pp_ends_group(dims, mesh),
                   expert_mesh=_expert_mesh(dims, mesh))


def _flatten(mesh: DeviceMesh, names: tuple[str, ...], name: str) -> DeviceMesh:
    """`names` of `mesh` as one dimension, `name` (each a dimension name or an Axis)."""
    flat = mesh[names]._flatten(name)
    set_group_timeout(flat.get_group())  # a new group: torch's default timeout otherwise
    return flat


def _fsdp_mesh(dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    if dims.cp > 1:
        shard = _flatten(mesh, (Axis.DP_SHARD, Axis.CP), "dp_shard_cp")
        return mesh[Axis.DP_REPLICATE, "dp_shard_cp"] if dims.dp_replicate > 1 else shard
    return mesh[Axis.DP_REPLICATE, Axis.DP_SHARD] if dims.dp_replicate > 1 else mesh[Axis.DP_SHARD]


def _loss_group(dims: ParallelDims, mesh: DeviceMesh) -> dist.ProcessGroup | None:
    if dims.dp * dims.cp == dims.world_size:
        return None
    names = tuple(axis for axis, degree in dims.degrees.items((Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP))
                  if degree > 1)
    if len(names) <= 1:
        return mesh[names[0] if names else Axis.DP_SHARD].get_group()
    return _flatten(mesh, names, "dp_cp").get_group()


def _pp_ends_group(dims: ParallelDims, mesh: DeviceMesh) -> dist.ProcessGroup | None:
    if dims.pp == 1:
        return None
    ranks = mesh.mesh.reshape(dims.pp, -1)  # (pp, every other coordinate): global ranks
    column = (ranks == dist.get_rank()).nonzero()[0, 1]
    pair = [int(ranks[0, column]), int(ranks[-1, column])]
    if pair[0] != dist.get_rank() and pair[1] != dist.get_rank():
        return None  # a middle stage: it holds no copy of a tied weight
    # Only the two ranks of a pair make it: the pairs are disjoint, and the other ranks
    # would otherwise join one creation barrier per pair (world / pp of them) at start-up.
    return new_group(pair, members_only=True)


def _expert_mesh(dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh | None:
    if dims.ep == 1:
        return None
    # Same ranks, dp_shard split as (efsdp, ep) with ep innermost of it, and ep moved next to tp:
    # an expert weight's mesh (FSDP's efsdp x cp, then ep) must list its dimensions in order.
    ranks = mesh.mesh.reshape(dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.cp, dims.tp)
    ranks = ranks.transpose(3, 4)  # (pp, dp_replicate, efsdp, cp, ep, tp)
    expert = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=EXPERT_MESH_DIMS)
    apply_timeout(expert)
    if dims.cp > 1:  # the experts' FSDP ranks: the same experts, other tokens
        _flatten(expert, (EFSDP, Axis.CP), "efsdp_cp")
    # Known to DTensor, the flattened (efsdp, ep) group lets it reduce an expert gradient's
    # norm in one all-reduce instead of one per dimension.
    _flatten(expert, (EFSDP, Axis.EP), "efsdp_ep")
    if dims.tp > 1:  # with TP the experts are spread over (ep, tp), their rows moved in one group
        _flatten(expert, (Axis.EP, Axis.TP), "ep_tp")
    return expert
