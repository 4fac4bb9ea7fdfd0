"""How a DeepSeek-V3 model is spread over ranks under tensor parallelism: its plan, as data.

Latent attention (forja/models/common/mla.py) splits by heads like ordinary attention:
the projections into per-head widths -- wq (or wq_b after the query latent) and wkv_b --
are column-parallel, wo is row-parallel. The projections into the latents (wq_a, wkv_a)
and their norms are small and stay whole on every rank, which computes them on the whole
input: under sequence parallelism the block gathers the sequence before attention and
hands attention a plain tensor, since those replicated layers are not DTensor-aware.

Their gradients are then complete on every rank (the column-parallel layers after them
sum their input gradients over the ranks), except along one path: the rotated key head
that all heads share reaches each rank's heads only, so its gradient is split over the
ranks. `SumGradients` on `attention.shared_key` sums it (Megatron-LM's "f": identity
forward, all-reduce backward), a (B, T, qk_rope_head_dim) all-reduce per layer.

Dense blocks' MLPs are Llama's (column-parallel w1/w3, row-parallel w2); mixture-of-experts
blocks take the attention part of this plan, their MoE layer split by tokens over the TP
ranks, router and shared expert replicated, routed experts spread over them (`TPPlan.block_plan`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput

from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.deepseek_v3.model import DeepSeekV3Args


class SumGradients(ParallelStyle):
    """Identity on a module's first input forward; in backward, that input's gradient
    (a partial sum on each rank) is summed over the tensor-parallel ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            replicated = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            # The gradient arriving here is this rank's share; declaring it Partial makes
            # from_local's backward redistribute it to Replicate: an all-reduce.
            return (replicated.to_local(grad_placements=[Partial()]), *inputs[1:])

        return distribute_module(module, device_mesh, input_fn=input_fn)


def deepseek_v3_tp_plan(args: DeepSeekV3Args, sequence_parallel: bool) -> TPPlan:
    plan = dense_tp_plan(sequence_parallel, gated_mlp=True)
    for name in ("attention.wq", "attention.wk", "attention.wv"):
        del plan.block[name]
    q_heads = "attention.wq_b" if args.q_lora_rank else "attention.wq"
    plan.block.update({
        q_heads: ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_key": SumGradients(),
    })
    if sequence_parallel:
        # The block calls attention(x, rope, mask, cache, layer); x is gathered and handed
        # over as a plain tensor for the replicated wq_a / wkv_a.
        plan.block["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None), use_local_output=True)
    return plan
