"""Tensor and sequence parallelism with DTensor (Megatron-LM's scheme, expressed as plans).

A family's plan (its ModelSpec's: models/<family>/parallelize.py, or the dense default of
models/common/tp_plan.py) maps module names to torch's parallel styles; this file applies
it to a model or a pipeline stage. The output projection stays vocabulary-sharded and the loss is computed under
`loss_parallel()`: full (tokens, vocab) logits never exist on one rank. The token embedding's
lookup is forja's own (vocab_embedding.py), so that its gradient is never whole either.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, loss_parallel, parallelize_module

from forja import fallbacks
from forja.models.common.moe import moe_layers
from forja.models.common.tp_plan import TPPlan, float8_styles
from forja.parallel.ac import CheckpointedBlock
from forja.parallel.regather import gathers_sequence, regather_in_backward, regather_policy
from forja.parallel.vocab_embedding import vocab_parallel_styles


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Apply `plan.root` to the model's own modules (those it has: a pipeline stage may
    lack the embedding) and `plan.block` to every block."""
    float8 = plan.float8 and _float8_styles_run(plan, tp_mesh)
    present = vocab_parallel_styles({k: v for k, v in plan.root.items() if _has(model, k)}, model)
    parallelize_module(model, tp_mesh, float8_styles(present, model) if float8 else present)
    for _, block, block_plan in _block_plans(model, plan):
        parallelize_module(block, tp_mesh, float8_styles(block_plan, block) if float8 else block_plan)
    model.tie_weights()  # both halves of a tied pair are sharded alike; make them one again
    if plan.sequence_parallel and model.tok_embeddings is None:  # a later pipeline stage
        mark_sequence_split_input(model, tp_mesh)


def _block_plans(model: nn.Module, plan: TPPlan) -> list:
    """(name, block, its plan) for every block of `model`."""
    return [(name, block, plan.block_plan(moe=bool(moe_layers(block)), kind=model.args.layer_type(int(name))))
            for name, block in model.layers.items()]


def regather_sequence_inputs(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, compiled: bool) -> None:
    """Under sequence parallelism, keep each gathered sublayer input split until backward
    (regather.py) in the blocks activation checkpointing left whole: eager, with hooks around
    the gathering sublayers; `compiled` (by inductor), under regather.py's checkpoint policy.
    Called after AC wraps the blocks, before compile; the caller rules out float8's gathers."""
    for name, block, block_plan in _block_plans(model, plan):
        gathering = [sub for sub, style in block_plan.items() if gathers_sequence(style)]
        if isinstance(block, CheckpointedBlock) or not gathering:
            continue
        if compiled:
            model.layers[name] = CheckpointedBlock(block, context_fn=regather_policy)
            continue
        for sub in gathering:
            regather_in_backward(block.get_submodule(sub), tp_mesh)


def _float8_styles_run(plan: TPPlan, tp_mesh: DeviceMesh) -> bool:
    """Whether the float8 layers can take torchao's float8 styles on this mesh.

    Under sequence parallelism those styles gather float8 tensors (activations forward,
    gradients backward), which NCCL moves and Gloo refuses ("Invalid scalar type"). There
    the float8 layers keep torch's styles instead: they still compute in float8, and TP's
    collectives move high precision, as torchtitan's rowwise float8 does."""
    if not plan.sequence_parallel or _backend(tp_mesh) != "gloo":
        return True
    fallbacks.record("parallel.tp.float8", asked="train.float8 with parallel.sequence_parallel",
                     instead="torch's tensor-parallel styles: all-gathers in high precision",
                     why="Gloo has no float8 collectives", fix="run on CUDA (NCCL) for float8 all-gathers")
    return False


def _backend(mesh: DeviceMesh) -> str:
    """The backend of the mesh's group for the mesh's device ("cpu:gloo,cuda:nccl" on GPUs)."""
    name = dist.get_backend(mesh.get_group())
    per_device = dict(part.split(":", 1) for part in name.split(",")) if ":" in name else {}
    return per_device.get(mesh.device_type, name)


def wait_for_embedding_output(model: nn.Module) -> None:
    """Hand the first (compiled) block an ordinary tensor, not the embedding's pending
    collective.

    Under TP the embedding's output is an AsyncCollectiveTensor: its all-reduce (or
    reduce-scatter) not yet waited on. torch 2.13 and 2.14 compile a module whose input is
    such a tensor with that input's gradient dropped: the embedding gets none, or a wrong
    one, or backward fails (scripts/repro_tp_compile.py shows it on 2 CPU ranks). Cloning the
    output outside the compiled region waits for the collective and costs one (B, T, dim)
    copy per forward. The hook sits on the embedding, not on the block: a compiled block's
    own hooks run inside its compiled region."""
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(_materialized)


def _materialized(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    return out.clone()


def mark_sequence_split_input(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A later pipeline stage under sequence parallelism receives this rank's (B, T/tp, dim)
    slice of the hidden states. Seen as a DTensor inside the model's forward, it has the
    whole sequence's shape, so positions (RoPE) cover all T; the first block takes the
    local slice again, as blocks do under sequence parallelism."""
    seq = (Shard(1),)
    parallelize_module(model, tp_mesh, PrepareModuleInput(input_layouts=seq, desired_input_layouts=seq,
                                                          use_local_output=False))
    blocks = list(model.layers.values())
    if blocks:
        rest = (None,) * 4  # rope, mask, cache, layer index
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(input_layouts=seq + rest,
                                                                  desired_input_layouts=seq + rest,
                                                                  use_local_output=True))


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Overlap TP's all-gathers and reduce-scatters with the matmuls that use them (CUDA).

    Compiled blocks get their collective+matmul pairs rewritten into chunked, overlapped
    kernels over symmetric memory. PyTorch offers this only through these two underscore
    names (as torchtitan uses them); they exist in torch 2.11 and later."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def _has(model: nn.Module, dotted: str) -> bool:
    """Whether `dotted` names a present module (a pipeline stage may lack the embedding)."""
    node = model
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return False
    return True


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """Where the loss and its backward run: vocabulary-parallel cross-entropy under TP."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (possibly replicated DTensor) value, such as a loss computed
    under `loss_parallel`."""
    return t.full_tensor() if isinstance(t, DTensor) else t
