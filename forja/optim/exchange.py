"""Distributed Muon's communication: whole matrices gathered to one owner each, and back.

Newton-Schulz needs whole matrices; FSDP, TP and EP hand each rank a block of each. For the
matrices of one step that live on one device mesh (flattened into one group of n ranks):

1. Units: a 2-D parameter is one matrix, a 3-D one (stacked experts) one matrix per expert.
   Every rank knows every rank's block of every parameter (its global offsets and sizes,
   exchanged once, at the first step: `Layouts`).
2. Owners: each unit gets one owner, balanced by size (largest first, to the least-loaded
   rank). A rank that holds a unit whole (an expert sharded only over experts) owns it
   itself: no bytes move for it.
3. Buckets of about `bucket_bytes` of units: one all_to_all_single delivers each owner the
   blocks of its units, the owner orthogonalizes them, and one all_to_all_single sends each
   rank its block of each result. A step costs 2 collectives per bucket; a rank receives
   about one matrix per matrix it owns plus its own blocks of the others' results.

Only `all_to_all_single` (uneven splits, zero-size ones included) is used: NCCL and Gloo
have it in torch 2.11 and 2.13 (forja/parallel/ep.py relies on it too; Gloo's list
`all_to_all` is missing from older torch). `COMM` counts what this rank's exchanges did,
for tests and bench/muon_comm.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

Block = tuple[int, int, int, int]  # (row offset, rows, column offset, columns) of one unit


@dataclass
class CommStats:
    """What this rank's Muon exchanges did since the last `reset`."""

    collectives: int = 0
    bytes_received: int = 0  # from other ranks (a rank's blocks for itself never travel)
    bytes_sent: int = 0

    def reset(self) -> None:
        self.collectives = self.bytes_received = self.bytes_sent = 0


COMM = CommStats()


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """forja's counted all_to_all_single: `send` (N,) in `send_splits` per rank -> (sum(recv_splits),)."""
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    me = dist.get_rank(group)
    COMM.collectives += 1
    COMM.bytes_received += (sum(recv_splits) - recv_splits[me]) * send.element_size()
    COMM.bytes_sent += (sum(send_splits) - send_splits[me]) * send.element_size()
    return recv


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def mesh_group(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, list[int]]:
    """One process group over every rank of `mesh`, and those global ranks in group order."""
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return group, dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():
        # Group rank = global rank, not the mesh's order: the world group, ordered by rank.
        return dist.group.WORLD, list(range(len(ranks)))
    key = tuple(sorted(ranks))
    if key not in _GROUPS:
        # Only its members create it (local synchronization); meshes with the same ranks share it.
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _GROUPS[key], list(key)


def local_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's block of `t`: global offsets and sizes, 3 each ((1, m, n) for a matrix)."""
    chunks = t.__create_chunk_list__()
    local = t.to_local()
    offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    if len(chunks) != 1 or torch.Size(sizes) != local.shape:
        raise ValueError(f"Muon: a shard of {tuple(t.shape)} with placements {t.placements} is not one block")
    if t.dim() == 2:
        return (0, *offsets), (1, *sizes)
    return offsets, sizes


class Layouts:
    """Every rank's block of each parameter, exchanged once per set of parameters."""

    def __init__(self) -> None:
        self._boxes: dict[tuple, torch.Tensor] = {}

    def boxes(self, key: tuple, tensors: list[DTensor], group, n: int) -> torch.Tensor:
        """(n, P, 6): per rank and tensor, offsets then sizes."""
        if key not in self._boxes:
            mine = torch.tensor([[*o, *s] for o, s in map(local_box, tensors)], dtype=torch.int64)  # (P, 6)
            if n > 1:
                mine = mine.to(tensors[0].device)
                out = [torch.empty_like(mine) for _ in range(n)]
                dist.all_gather(out, mine, group=group)
                mine = torch.stack(out).cpu()
            else:
                mine = mine[None]
            self._boxes[key] = mine
        return self._boxes[key]


@dataclass
class Unit:
    """One matrix: expert `expert` of tensor `index`, its owner, and every rank's block of it."""

    index: int
    expert: int
    rows: int
    cols: int
    blocks: list[Block | None]  # per group rank
    owner: int = -1
    sources: dict[int, Block] = field(default_factory=dict)  # rank -> block it sends the owner

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def plan_units(shapes: list[tuple[int, int, int]], boxes: torch.Tensor) -> list[Unit]:
    """Units of tensors of global shapes (E, m, n) with per-rank boxes (n, P, 6), owners dealt."""
    n = boxes.shape[0]
    units = []
    for i, (experts, rows, cols) in enumerate(shapes):
        for e in range(experts):
            blocks: list[Block | None] = []
            for r in range(n):
                (e0, r0, c0, ne, nr, nc) = boxes[r, i].tolist()
                blocks.append((r0, nr, c0, nc) if e0 <= e < e0 + ne and nr * nc > 0 else None)
            units.append(Unit(i, e, rows, cols, blocks))
    deal_owners(units, n)
    for u in units:
        _choose_sources(u)
    return units


def deal_owners(units: list[Unit], n: int) -> None:
    """Largest unit first, to the least-loaded rank (ties: the lower rank); a unit held whole
    by some ranks goes to the least-loaded of those."""
    load = [0] * n
    for u in sorted(units, key=lambda u: (-u.numel, u.index, u.expert)):
        whole = [r for r, b in enumerate(u.blocks) if b is not None and b[1] * b[3] == u.numel]
        candidates = whole or range(n)
        u.owner = min(candidates, key=lambda r: (load[r], r))
        load[u.owner] += u.numel


def _choose_sources(u: Unit) -> None:
    """Which rank sends the owner each distinct block it lacks: the lowest holder."""
    covered, seen = 0, set()
    own = u.blocks[u.owner]
    for r, b in enumerate(u.blocks):
        if b is None or b in seen:
            continue
        seen.add(b)
        covered += b[1] * b[3]
        if b != own:
            u.sources[r] = b
    if covered != u.numel:
        raise ValueError(f"Muon: the shards of a {u.rows} x {u.cols} matrix do not tile it")


def buckets(units: list[Unit], bucket_numel: int) -> list[list[Unit]]:
    """The units that need communication, in order, cut into buckets of about `bucket_numel`."""
    out: list[list[Unit]] = []
    size = 0
    for u in units:
        moving = u.sources or any(b is not None for r, b in enumerate(u.blocks) if r != u.owner)
        if not moving:
            continue
        if not out or size + u.numel > bucket_numel and out[-1]:
            out.append([])
            size = 0
        out[-1].append(u)
        size += u.numel
    return out


def _slice(local: torch.Tensor, box_offset: tuple[int, ...], u: Unit) -> torch.Tensor:
    """This rank's block of unit `u`: its expert's whole (m_l, n_l) of the local (E_l, m_l, n_l)."""
    return local[u.expert - box_offset[0]]


def exchange_bucket(bucket: list[Unit], locals_: list[torch.Tensor], offsets: list[tuple[int, ...]],
                    outputs: list[torch.Tensor], me: int, n: int, group,
                    orthogonalize: Callable[[list[Unit], list[torch.Tensor]], list[torch.Tensor]]) -> None:
    """Gather each unit to its owner, orthogonalize there, write every rank's block of the
    result into `outputs` (local tensors shaped like `locals_`)."""
    # 1. Blocks to owners: this rank sends the blocks it is the source of, in unit order.
    send = [[] for _ in range(n)]
    recv_sizes = [0] * n
    for u in bucket:
        if me in u.sources:
            send[u.owner].append(_slice(locals_[u.index], offsets[u.index], u).reshape(-1))
        if u.owner == me:
            for r, b in u.sources.items():
                recv_sizes[r] += b[1] * b[3]
    received = _all_to_all(send, recv_sizes, group, locals_[0])
    # 2. The owner assembles and orthogonalizes its units.
    mine = [u for u in bucket if u.owner == me]
    fulls = []
    for u in mine:
        full = locals_[u.index].new_empty(u.rows, u.cols)
        own = u.blocks[me]
        if own is not None:
            _place(full, own, _slice(locals_[u.index], offsets[u.index], u))
        fulls.append(full)
    for r in range(n):  # received: by source rank, each in unit order
        for u, full in zip(mine, fulls):
            if r in u.sources:
                b = u.sources[r]
                _place(full, b, received[r][: b[1] * b[3]].view(b[1], b[3]))
                received[r] = received[r][b[1] * b[3]:]
    results = orthogonalize(mine, fulls)
    # 3. Results back: every other holder of a block gets its block.
    send = [[] for _ in range(n)]
    recv_sizes = [0] * n
    for u, result in zip(mine, results):
        for r, b in enumerate(u.blocks):
            if b is not None and r != me:
                send[r].append(result[b[0]:b[0] + b[1], b[2]:b[2] + b[3]].reshape(-1))
        if u.blocks[me] is not None:
            b = u.blocks[me]
            _out(outputs, offsets, u).copy_(result[b[0]:b[0] + b[1], b[2]:b[2] + b[3]])
    for u in bucket:
        b = u.blocks[me]
        if u.owner != me and b is not None:
            recv_sizes[u.owner] += b[1] * b[3]
    received = _all_to_all(send, recv_sizes, group, locals_[0])
    for u in bucket:
        b = u.blocks[me]
        if u.owner != me and b is not None:
            _out(outputs, offsets, u).copy_(received[u.owner][: b[1] * b[3]].view(b[1], b[3]))
            received[u.owner] = received[u.owner][b[1] * b[3]:]


def _out(outputs: list[torch.Tensor], offsets: list[tuple[int, ...]], u: Unit) -> torch.Tensor:
    return outputs[u.index][u.expert - offsets[u.index][0]]


def _place(full: torch.Tensor, b: Block, block: torch.Tensor) -> None:
    full[b[0]:b[0] + b[1], b[2]:b[2] + b[3]] = block


def _all_to_all(send: list[list[torch.Tensor]], recv_sizes: list[int], group,
                like: torch.Tensor) -> list[torch.Tensor]:
    """Per destination lists of flat blocks out; the flat data received, per source."""
    flat = [torch.cat(s) if s else like.new_empty(0) for s in send]
    received = all_to_all(torch.cat(flat), [t.numel() for t in flat], recv_sizes, group)
    return list(received.split(recv_sizes))
