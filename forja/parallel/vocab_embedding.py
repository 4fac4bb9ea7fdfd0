"""The token embedding split over the vocabulary, with a gradient only for the rank's rows.

A plan names the embedding `RowwiseParallel` (torch's style: weight `Shard(0)`, the lookup's
output a partial sum). DTensor's embedding backward has no vocabulary-split strategy: every
rank scatters its tokens' gradients into a whole (vocab, dim) tensor, which is then
reduce-scattered to the rank's rows. For Llama 3.1 405B under TP 8 that is 7.8 GiB in fp32 on
the first pipeline stage for a moment, and a (vocab, dim) reduce-scatter every step, where
Megatron-LM's VocabParallelEmbedding holds and moves only (vocab/tp, dim) and (B, T, dim).

`vocab_parallel_styles` swaps such a style for `VocabParallelEmbedding`, which does the
lookup on the local rows itself: tokens outside them read row 0 and are zeroed, the output is
that same partial sum (then reduced or reduce-scattered to the plan's layout), and autograd
scatters the gradient into the local (vocab/tp, dim) shard only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel


class VocabParallelEmbedding(ParallelStyle):
    """An `nn.Embedding` over a 1-D TP mesh: weight rows split as `torch.chunk` splits them
    (DTensor's `Shard(0)`), the output in `output_layout` (Replicate, or Shard(1) under
    sequence parallelism), a plain tensor when `use_local_output`."""

    def __init__(self, output_layout: Placement, *, use_local_output: bool = True):
        super().__init__()
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise TypeError(f"VocabParallelEmbedding takes a plain nn.Embedding, got {module!r}")
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)])
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
        # The instance's forward, not the class's: FSDP swaps `module.weight` for the gathered
        # parameter before each call, so the lookup reads it at call time.
        module.forward = functools.partial(_lookup, module, device_mesh, self.output_layout, self.use_local_output)
        return module


def _lookup(module: nn.Embedding, mesh: DeviceMesh, layout: Placement, use_local_output: bool,
            tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(tokens, DTensor):
        tokens = tokens.to_local()  # the plan's input is replicated: every rank has all ids
    weight = module.weight.to_local()  # (vocab/tp, dim): autograd hands back a Shard(0) gradient
    rows_per_rank = -(-module.num_embeddings // mesh.size())  # torch.chunk's split
    first = mesh.get_local_rank() * rows_per_rank
    elsewhere = (tokens < first) | (tokens >= first + weight.shape[0])  # (B, T)
    local = F.embedding((tokens - first).masked_fill(elsewhere, 0), weight)  # (B, T, dim)
    local = local.masked_fill(elsewhere.unsqueeze(-1), 0.0)
    out = DTensor.from_local(local, mesh, [Partial()], run_check=False).redistribute(mesh, [layout])
    return out.to_local() if use_local_output else out


def vocab_parallel_styles(plan: dict[str, ParallelStyle], model: nn.Module) -> dict[str, ParallelStyle]:
    """`plan` with each `RowwiseParallel` over an `nn.Embedding` (replicated ids in) made a
    `VocabParallelEmbedding` with the same output layout."""
    out = dict(plan)
    for name, style in plan.items():
        module = model.get_submodule(name)
        if type(style) is RowwiseParallel and type(module) is nn.Embedding and module.padding_idx is None \
                and module.max_norm is None:
            out[name] = VocabParallelEmbedding(style.output_layouts[0], use_local_output=style.use_local_output)
    return out
