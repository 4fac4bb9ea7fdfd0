"""How a Llama model is spread over ranks: the only Llama file that knows parallelism.

`parallelize_llama` applies, in the order written down in forja/parallel/__init__.py:
tensor/sequence parallelism (the plan below) -> activation checkpointing -> per-block
compile -> FSDP. Pipeline splitting happens before, in forja/parallel/pp.py.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from forja.models.common.transformer import Transformer
from forja.parallel.ac import apply_ac
from forja.parallel.compile import apply_compile
from forja.parallel.config import ParallelConfig
from forja.parallel.dims import ParallelDims
from forja.parallel.fsdp import apply_fsdp, wants_fsdp
from forja.parallel.tp import apply_tp, enable_async_tp, mark_sequence_split_input


def tp_plans(sp: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(plan of the model's own modules, plan of each block). `sp`: sequence parallel.

    Between blocks the residual stream is (B, T/tp, dim) per rank with SP, (B, T, dim)
    without; inside attention and the MLP, heads and hidden columns are split."""
    seq = Shard(1) if sp else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Logits stay split over the vocabulary: the loss runs under loss_parallel().
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        root["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the projections: attention needs every position.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return root, block


def apply_layout(model: Transformer, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelConfig,
                 plans: tuple[dict, dict]) -> None:
    """The steps every family takes, given its TP plans."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], *plans)
        if cfg.async_tp:
            enable_async_tp(mesh["tp"])
        if cfg.sequence_parallel and model.tok_embeddings is None:  # a later pipeline stage
            mark_sequence_split_input(model, mesh["tp"])
    apply_ac(model, cfg)
    if cfg.compile:
        apply_compile(model)
    if wants_fsdp(dims, cfg):
        apply_fsdp(model, mesh, dims, cfg)


def parallelize_llama(model: Transformer, dims: ParallelDims, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    sp = cfg.sequence_parallel and dims.tp > 1
    apply_layout(model, dims, mesh, cfg, tp_plans(sp))
