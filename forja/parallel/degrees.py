"""The degrees of a parallel layout: one value with named axes.

    d = ParallelConfig(tp=2, pp=2).degrees.resolve(world_size=8)   # dp_shard = -1 filled: 2
    d[Axis.TP], d.tp, d.dp, d.world_size                            # 2, 2, 2, 8
    d.describe("ring")                                              # 'dp_shard 2 x tp 2 x pp 2'

The `[parallel]` section (config.py) gives its degrees as a `Degrees`, the planner's `Layout`
holds one and `ParallelDims` (dims.py) builds the mesh from one, so the axes are named once,
here, in `Axis`: the mesh's dimensions outermost first, then expert parallelism, which
borrows its ranks from dp_shard and is not a dimension of the world mesh.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from forja.errors import ForjaError


class Axis(str, enum.Enum):
    """A kind of parallelism, spelled as its `parallel.*` key. Members are strings, so an axis
    and its key are one dictionary key, one mesh dimension name and one keyword."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EP = "ep"

    # Python's enums hash and print by member name; an axis must behave as its key does.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# The world mesh's dimensions, outermost first: tensor parallelism innermost, so its
# latency-bound collectives stay within a node; pipeline stages outermost.
MESH_AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)
# The order a recipe, `forja plan`'s table and a layout's --set line name the degrees in.
KEY_ORDER = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP, Axis.PP, Axis.CP, Axis.EP)
# The ranks of one micro-batch's forward besides the data-parallel ones: what dp_shard = -1
# divides the world size by.
_NOT_DATA = (Axis.DP_REPLICATE, Axis.TP, Axis.PP, Axis.CP)


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """How many ranks each kind of parallelism spreads over; dp_shard = -1 (only from a
    config, before `resolve`) takes what the others leave of the world size."""

    pp: int = 1
    """Pipeline stages."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's outer dimension)."""
    dp_shard: int = 1
    """FSDP's sharding degree, or -1 for the rest of the world."""
    cp: int = 1
    """Context parallelism: ranks splitting each sequence."""
    tp: int = 1
    """Tensor parallelism: ranks splitting heads and FFN columns."""
    ep: int = 1
    """Expert parallelism: dp_shard ranks splitting the routed experts (it must divide dp_shard)."""

    def __post_init__(self) -> None:
        for axis, degree in self.items():
            if axis is Axis.DP_SHARD:
                if degree < 1 and degree != -1:
                    raise ForjaError(f"parallel.dp_shard = {degree} must be at least 1, or -1 for the rest")
            elif degree < 1:
                raise ForjaError(f"parallel.{axis} = {degree} must be at least 1")

    def __getitem__(self, axis: Axis) -> int:
        return getattr(self, axis.value)

    def items(self, order: tuple[Axis, ...] = tuple(Axis)) -> Iterator[tuple[Axis, int]]:
        """(axis, degree) pairs, in `order` (default: the mesh's, then ep)."""
        return ((axis, self[axis]) for axis in order)

    def keys(self) -> dict[str, int]:
        """The degrees as `parallel.*` key names (without the section) -> value, in KEY_ORDER."""
        return {axis.value: degree for axis, degree in self.items(KEY_ORDER)}

    @property
    def world_size(self) -> int:
        """Ranks of the layout: the product of the mesh's degrees (ep borrows from dp_shard)."""
        size = 1
        for _, degree in self.items(MESH_AXES):
            size *= degree
        return size

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks a parameter is sharded over: dp_shard joined with cp (ParallelDims.fsdp_mesh)."""
        return self.dp_shard * self.cp

    def resolve(self, world_size: int) -> Degrees:
        """These degrees on `world_size` ranks: dp_shard = -1 filled, and checked that expert
        parallelism divides dp_shard and that the degrees make the world size."""
        others = 1
        for _, degree in self.items(_NOT_DATA):
            others *= degree
        dims = self
        if self.dp_shard == -1:
            if world_size % others:
                raise ForjaError(f"world size {world_size} is not divisible by dp_replicate*tp*pp*cp = {others}; "
                                 "change the parallel degrees or the number of processes")
            dims = replace(self, dp_shard=world_size // others)
        if dims.ep > 1 and dims.dp_shard % dims.ep:
            raise ForjaError(f"parallel.ep = {dims.ep} does not divide parallel.dp_shard = {dims.dp_shard}: expert "
                             "parallelism borrows its ranks from dp_shard; choose an ep that divides it")
        if dims.world_size != world_size:
            product = " x ".join(f"{axis}={degree}" for axis, degree in dims.items(MESH_AXES))
            raise ForjaError(f"parallel degrees multiply to {dims.world_size} ({product}) but {world_size} processes "
                             "run; make them equal (parallel.dp_shard = -1 fills the rest)")
        return dims

    def describe(self, cp_kind: str = "ring") -> str:
        """A short name, e.g. 'dp_shard 8 x tp 8 x pp 4' (a CP degree names its kind: 'cp 4
        ring'); '1 rank' without any parallelism."""
        parts = [f"{axis} {degree}" + (f" {cp_kind}" if axis is Axis.CP else "")
                 for axis, degree in self.items(KEY_ORDER) if degree > 1]
        return " x ".join(parts) or "1 rank"


AXIS_NAMES = frozenset(f.name for f in fields(Degrees))


def _held(name: str, doc: str) -> property:
    """A read-only attribute that reads `name` of the held `degrees`."""
    return property(lambda self: getattr(self.degrees, name), doc=doc)


class WithDegrees:
    """Read access to a held `degrees` value, as loose attributes: `x.tp`, `x.dp`,
    `x.world_size` (a planner's Layout, the mesh builder's ParallelDims)."""

    degrees: Degrees

    pp = _held("pp", "Pipeline stages.")
    dp_replicate = _held("dp_replicate", "Data-parallel replicas.")
    dp_shard = _held("dp_shard", "FSDP's sharding degree.")
    cp = _held("cp", "Ranks splitting each sequence.")
    tp = _held("tp", "Ranks splitting heads and FFN columns.")
    ep = _held("ep", "dp_shard ranks splitting the routed experts.")
    world_size = _held("world_size", "Ranks of the layout.")
    dp = _held("dp", "Data-parallel degree: how many different batches are processed at once.")
    fsdp = _held("fsdp", "Ranks a parameter is sharded over (dp_shard joined with cp, as ParallelDims.fsdp_mesh).")
