"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`).

Each transformer block is one FSDP unit (its parameters gathered just before it runs and
freed after), and the root holds the rest: embeddings, final norm, output. With
`dp_replicate > 1` the mesh is 2-D: parameters are sharded within a group and replicated
across groups (HSDP; with dp_shard = 1 that is plain replication, as DDP does).

ZeRO stages: optimizer state and gradients are always sharded (ZeRO-2);
`reshard_after_forward` also frees the gathered parameters between forward and backward
(ZeRO-3), trading a second all-gather for memory. With gradient accumulation FSDP reduces
each micro-batch's gradients and regathers the parameters for the next; `grad_sync = "step"`
(`hold_gradients`) keeps both gathered parameters and whole gradients until the step's last
micro-batch instead, so a step makes one all-gather and one reduce-scatter: the memory and the
traffic of Megatron's distributed optimizer.

CPU offload keeps the sharded parameters, their gradients and the optimizer state in
CPU memory; FSDP copies each unit's shards to the device for its forward and backward.
FSDP requires the offloaded model to be materialized on the CPU (the build order does
so), and page-locked (pinned) CPU memory exists only with CUDA, so on a CPU-only machine
offload runs unpinned: a no-op in memory terms, but the same code path, tested in CI.

Under expert parallelism each MoE layer's routed experts are their own FSDP unit over the
expert mesh's data-parallel ranks (`dims.expert_fsdp_mesh`, with the cp ranks): their gradients
already sum the tokens of the whole EP group, so the reduction divides by the full data-parallel
degree (times cp).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from forja.models.common.moe import moe_layers
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims


def wants_fsdp(dims: ParallelDims, cfg: ParallelConfig) -> bool:
    """FSDP also serves one rank: it is how bf16 parameters and CPU offload are applied."""
    return dims.dp * dims.cp > 1 or cfg.mixed_precision == "bf16" or cfg.cpu_offload


def apply_fsdp(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, device: torch.device) -> None:
    kwargs = {"mesh": dims.fsdp_mesh}
    if cfg.mixed_precision == "bf16":
        # Compute in bf16, but reduce gradients in fp32: summing many bf16 gradients loses bits.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them.
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        if dims.ep > 1:
            _shard_experts(block, dims, reshard, kwargs)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)


def hold_gradients(model: nn.Module, hold: bool) -> None:
    """Before each micro-batch under parallel.grad_sync = "step": `hold` (every one but the
    step's last) accumulates whole gradients and keeps the parameters gathered after backward;
    the last reduce-scatters the sum and frees them."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(not hold)  # recurses into every unit, experts' included
        model.set_reshard_after_backward(not hold)


def _shard_experts(block: nn.Module, dims: ParallelDims, reshard: bool, kwargs: dict) -> None:
    """Make a block's routed experts (sharded over "ep" already) an FSDP unit of their own."""
    mesh = dims.expert_fsdp_mesh
    for _, moe in moe_layers(block):
        placement = _expert_placement(moe.experts, mesh.shape[-1])
        fully_shard(moe.experts, reshard_after_forward=reshard, **{**kwargs, "mesh": mesh, **placement})
        # Each expert's gradient sums every EP rank's tokens: average over all dp (x cp) ranks.
        moe.experts.set_gradient_divide_factor(float(dims.dp * dims.cp))
        if dims.dp_shard // dims.ep * dims.cp > 1:
            # A custom factor is applied with NCCL's PREMUL_SUM, which Gloo lacks: divide apart.
            # Not with one shard: torch 2.11-2.13 then divide twice (the copy and the post-divide).
            moe.experts.set_force_sum_reduction_for_comms(True)


def _expert_placement(experts: nn.Module, shards: int) -> dict:
    """FSDP splits a parameter's first dim: a rank's experts (E / ep, ...). When they do not
    divide among the `shards` ranks holding them (Mixtral's 8 experts under EP 8 over 64 ranks:
    one expert, 8 ranks), the first ranks would keep whole experts and the rest none; each
    expert's rows (dim 1) are split instead, as torchtitan does."""
    local_experts = next(iter(experts.parameters())).to_local().shape[0]
    return {} if local_experts % shards == 0 else {"shard_placement_fn": lambda param: Shard(1)}
