"""Every collective of a rehearsed step, by kind and group: count and bytes.

Both spellings of a collective reach the dispatcher: the process group's own ops
(`torch.ops.c10d`, FSDP's all-gather and reduce-scatter, the pipeline's send and receive)
and the functional ones (`torch.ops._c10d_functional`, what DTensor and tensor parallelism
issue). A group is named as the run's mesh names it (`dp_shard`, `tp`, `dp_shard_cp`, ...):
`groups` maps torch's group names to those.

Bytes are those the collective's largest side holds on this rank: an all-gather's output,
a reduce-scatter's input, an all-reduce's tensor, a send's tensor.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")


@dataclass
class Traffic:
    count: int = 0
    bytes: int = 0


class CollectiveLog:
    """Counts and bytes by (kind, group)."""

    def __init__(self, groups: dict[str, str]):
        self.groups = groups
        self.by: dict[tuple[str, str], Traffic] = defaultdict(Traffic)

    def record(self, func, args: tuple, kwargs: dict, out) -> bool:
        """Count `func` if it is a collective; whether it was."""
        if func.namespace not in _NAMESPACES:
            return False
        kind = func._opname.rstrip("_").lstrip("_")
        if func._opname in _NOT_COLLECTIVES:
            return False
        group = self._group(tree_leaves((args, kwargs)))
        sides = [sum(t.nbytes for t in tree_leaves(x) if isinstance(t, torch.Tensor)) for x in (args, out)]
        traffic = self.by[(kind, group)]
        traffic.count += 1
        traffic.bytes += max(sides)
        return True

    def _group(self, leaves: list) -> str:
        for x in leaves:
            if isinstance(x, str) and x in self.groups:
                return self.groups[x]
            if isinstance(x, torch.ScriptObject):  # the c10d ops take the group boxed
                try:
                    x = dist.ProcessGroup.unbox(x)
                except RuntimeError:
                    continue  # another boxed argument (a ReduceOp)
            if isinstance(x, dist.ProcessGroup):
                return self.groups.get(x.group_name, f"{x.size()} ranks")
        return "?"

    def as_rows(self) -> list[dict]:
        return [{"kind": k, "group": g, "count": t.count, "bytes": t.bytes}
                for (k, g), t in sorted(self.by.items())]


def mesh_group_names(mesh) -> dict[str, str]:
    """torch's group name -> the mesh dimension's name, over `mesh` and the meshes flattened
    from it (torch keeps them on the root mesh)."""
    names: dict[str, str] = {}
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    candidates = list(root.mesh_dim_names or ())
    flattened = getattr(getattr(root, "_flatten_mapping", None), "keys", None)
    candidates += list(flattened()) if flattened else []
    for dim in candidates:
        try:
            group = root[dim].get_group()
        except (KeyError, RuntimeError, ValueError):
            continue
        names.setdefault(group.group_name, dim)
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names
