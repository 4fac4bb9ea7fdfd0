"""Expert parallelism: a mixture of experts' routed experts sharded over the "ep" ranks.

EP borrows its ranks from data parallelism (parallel.ep divides parallel.dp_shard): the
ranks of an EP group see different tokens, each holds n_experts / ep of the experts, and
every MoE layer moves each routed token-slot to the rank holding its expert and back:

    tokens sorted by expert (M, D), rows per expert (E,)
      -> all_to_all of the counts         each rank learns how many rows it will receive
      -> all_to_all of the rows           uneven splits: (rows from rank 0, 1, ...), each by expert
      -> regroup by local expert, grouped matmuls, ungroup
      -> all_to_all back                  the results return to the tokens' ranks

`all_to_all_single` with split sizes runs on NCCL and on Gloo, so EP is tested on CPU. The
router, the shared experts and attention stay data-parallel. EP's exchanges are torch's
functional collective (`_c10d_functional.all_to_all_single`: a new tensor out of one op), whose
outputs op-level activation checkpointing keeps (forja/parallel/ac.py): recomputing a block
replays its exchanges from what the forward received instead of communicating again (the
process group's own op writes into a buffer the checkpoint cannot keep, and ran them again).

Under tensor parallelism the TP ranks split each MoE layer's tokens between them
(`SplitTokens` in forja/models/common/tp_plan.py): for the experts they are data-parallel
ranks too, so the experts are spread over them the same way (`expert_layout`): over "tp"
alone, or over ("ep", "tp") with EP, each rank holding n_experts / (ep x tp). Each
expert's rows then come from every rank of that group, its gradient is whole on its rank,
and no expert's work is repeated on two TP ranks.

The experts' stacked weights become DTensors sharded on dim 0 over the expert mesh's "ep"
dimension; FSDP then shards each rank's experts over the remaining data-parallel ranks
("efsdp", see dims.py), as its own FSDP unit. An expert's gradient sums the contributions
of every EP rank's tokens, so FSDP's reduction divides it by the whole data-parallel
degree, not the FSDP group's size (forja/parallel/fsdp.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard, distribute_tensor

from forja.eager import eager_only
from forja.models.common.moe import GroupedExperts, moe_layers
from forja.parallel.dims import ParallelDims


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows x[in_splits[r] block] go to rank r; returns the rows received, by source rank (no
    gradient). One functional all_to_all_single: op-level AC keeps its output (the module docstring).
    The wait is torch.distributed's own function: a rank blocked in it shows the hang watchdog
    (forja/train/resilience/watchdog.py) a collective's frame, as the process group's op did."""
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name)
    return funcol.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the other way.
    `kept`: through `exchange` (EP's rows), whose output op-level AC keeps; otherwise the process
    group's own op, which a recomputed block runs again (context parallelism's, forja/parallel/cp/comm.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, kept: bool) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.kept = (out_splits, in_splits), group, kept
        return _all_to_all(x, out_splits, in_splits, group, kept)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.kept), None, None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, kept: bool) -> torch.Tensor:
    if kept:
        return exchange(x, out_splits, in_splits, group)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, kept: bool = False) -> torch.Tensor:
    """Rows x[in_splits[r] block] go to rank r; returns the rows received, by source rank
    (differentiable). `kept`: op-level AC keeps the result rather than exchanging it again."""
    return _AllToAll.apply(x, out_splits, in_splits, group, kept)


class ExpertDispatch:
    """Installs the dispatch around one `GroupedExperts`: a forward pre-hook sends its
    rows to the experts' ranks, a forward hook brings the results back."""

    def __init__(self, experts: GroupedExperts, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep
        self._pending: list[tuple] = []  # per forward in flight: how to send the results back
        experts.register_forward_pre_hook(self.dispatch)
        experts.register_forward_hook(self.combine)

    @eager_only  # data-dependent split sizes: run eagerly inside compiled blocks
    def dispatch(self, module: nn.Module, inputs: tuple) -> tuple:
        x, counts = inputs  # (M, D) sorted by global expert; (E,) rows per global expert
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.dtype == torch.float32:
            # The experts' first matmul casts its input to autocast's dtype anyway: cast before
            # sending, and the rows travel in half the bytes with the same values (their
            # gradients come back in that dtype too, as the matmul makes them).
            x = x.to(torch.get_autocast_dtype(device))
        local = counts.numel() // self.ep
        even = [local] * self.ep
        received = exchange(counts, even, even, self.group)  # (ep * local,): rows from each source
        received = received.view(self.ep, local)  # (source rank, local expert)
        send, recv = self.split_sizes(counts.view(self.ep, local), received, x.shape[0])
        rows = all_to_all(x, recv, send, self.group, kept=True)  # (R, D): by source rank, then by expert
        order = _by_expert(received, sum(recv))  # rows regrouped by local expert, then by source
        self._pending.append((order, send, recv))
        return rows[order], received.sum(0)

    @staticmethod
    def split_sizes(sending: torch.Tensor, received: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
        """Rows to send to each rank and rows to receive from each, on the host (a
        device-to-host wait per MoE layer): sending (ep, local) rows for each rank's experts,
        received (ep, local) rows each rank sends here; `rows` this rank's, their sum."""
        return sending.sum(1).tolist(), received.sum(1).tolist()

    @eager_only
    def combine(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        order, send, recv = self._pending.pop()
        back = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping
        return all_to_all(back, send, recv, self.group, kept=True)


def _by_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that turns blocks (source, expert) into (expert, source).

    received (S, L): rows source s sent for local expert l, laid out source-major;
    `total` their sum (known on the host: no device sync here)."""
    flat = received.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(received)  # (S, L) first row of each block
    sizes = received.t().flatten()  # (L S,) blocks in the wanted order
    first = starts.t().flatten()
    offset_in_block = torch.arange(total, device=received.device) - torch.repeat_interleave(
        torch.cumsum(sizes, 0) - sizes, sizes, output_size=total)
    return torch.repeat_interleave(first, sizes, output_size=total) + offset_in_block


def expert_layout(dims: ParallelDims) -> tuple[DeviceMesh, tuple[Placement, ...], dist.ProcessGroup] | None:
    """(mesh of the experts' weights, their placements, the group their rows move in), or
    None when every rank holds every expert (no EP, no TP)."""
    if dims.ep > 1 and dims.tp > 1:
        mesh = dims.groups.expert_mesh
        # Sharded over ep, then each ep shard over tp: rank (e, t) holds block e * tp + t,
        # which is its index in the flattened ("ep", "tp") group the rows move in.
        return mesh["ep", "tp"], (Shard(0), Shard(0)), mesh["ep_tp"].get_group()
    if dims.ep > 1:
        return dims.ep_mesh, (Shard(0),), dims.ep_mesh.get_group()
    if dims.tp > 1:
        return dims.tp_mesh, (Shard(0),), dims.tp_mesh.get_group()
    return None


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, placements: tuple[Placement, ...] = (Shard(0),),
             group: dist.ProcessGroup | None = None) -> None:
    """Shard every MoE layer's routed experts over `ep_mesh` (`placements`: Shard(0) on each
    of its dimensions) and route tokens to them through `group` (default: the 1-D mesh's);
    the model may be on the meta device."""
    group = group if group is not None else ep_mesh.get_group()
    ranks = dist.get_world_size(group)
    for _, moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: each rank keeps its slice, no scatter (weights are initialized later).
            shard = distribute_tensor(param.data, ep_mesh, list(placements), src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        ExpertDispatch(experts, group, ranks)
