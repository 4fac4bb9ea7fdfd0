"""Activation checkpointing: recompute activations in backward instead of keeping them.

- full: every block keeps only its input; everything inside is recomputed.
- selective, every k-th block (`parallel.ac_every = k`): full checkpointing of blocks
  0, k, 2k, ...; the others keep everything.
- selective, op-level (`ac_every = 0`): every block keeps the outputs of its matmuls and
  attention (expensive to recompute), of expert parallelism's all-to-alls (communication) and
  of the router's top-k (the experts those rows went to), and recomputes the cheap elementwise
  ops (norms, activations, RoPE), which hold much of the memory (Korthikanti et al. 2022). With
  `ac_matmuls = "alternate"` it keeps only every second `mm` of a block's (the 1st, 3rd, ...;
  torchtitan's op-level policy), recomputing the others: less memory for more FLOPs.

The wrapper module names its child `_checkpoint_wrapped_module` (the name PyTorch's
checkpoint helpers and forja's init recognize) and leaves that name out of its state dict,
so checkpoints are the same with or without activation checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from forja.parallel.config import ParallelConfig

# Ops whose outputs op-level selective checkpointing keeps.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,  # the routed experts' matmuls (forja/ops/grouped_mm.py)
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    # cuDNN's SDPA (torch's choice on Hopper and Blackwell where it applies) and FlexAttention's
    # higher-order op (forja's attention on CUDA): the memory model prices their outputs as kept
    # (forja/plan/activations.py), and recomputing them would run attention's forward twice.
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.higher_order.flex_attention,
    # The router's picks: a recomputed block then routes its tokens as the forward did, to the
    # experts whose kept rows and matmul outputs backward reads (a recomputed top-k that broke a
    # tie the other way would pair them with other tokens' weights). Run without gradients (an
    # indexer's selection) it is recomputed like the rest.
    torch.ops.aten.topk.default,
}


# Collectives whose outputs op-level selective checkpointing keeps, whatever the grad mode (an
# autograd Function's forward runs without it): recomputing the block replays what they
# received instead of communicating again. Expert parallelism's exchanges, counts and rows,
# there and back (forja/parallel/ep.py), as torchtitan's policy keeps them.
_SAVED_COLLECTIVES = {torch.ops._c10d_functional.all_to_all_single.default}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # Only what backward reads: a matmul run without gradients (DeepSeek Sparse Attention's
    # indexer scores, (B, T, H_I, T) a block) is recomputed with the block, not kept.
    saved = (op in _SAVED_OPS and torch.is_grad_enabled()) or op in _SAVED_COLLECTIVES
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _save_alternate_matmuls():
    """A policy keeping every second `mm` of one block's: the forward and its recomputation
    count their own calls, so the replay decides as the forward did."""
    calls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            calls[ctx.is_recompute] += 1
            if calls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _save_matmuls(ctx, op)

    return policy


def _op_level_context(alternate: bool = False):
    return create_selective_checkpoint_contexts(_save_alternate_matmuls() if alternate else _save_matmuls)


def _eager_op_level_context(block: nn.Module, alternate: bool = False):
    forward, recompute = _op_level_context(alternate)
    return forward, _within_forward_root(block, recompute)


@contextlib.contextmanager
def _within_forward_root(block: nn.Module, recompute) -> Iterator[None]:
    """Recompute `block` as its forward ran: inside FSDP's forward root. Selective AC replays the
    forward's ops and refuses any it did not record (torch 2.13 counts them all). A unit nested
    in the block (the routed experts under EP) saw the model's root claimed in the forward; in a
    pipeline's backward the root's forward is long over, so the nested unit would claim it and
    run the root's start-up ops (profiler ranges, stream waits, input copies) the forward never
    ran. The block's own FSDP state stands in as the root while it recomputes."""
    state = block._get_fsdp_state() if isinstance(block, FSDPModule) else None
    context = state._state_ctx if state is not None else None
    claimed = context is not None and context.iter_forward_root is None
    if claimed:
        context.iter_forward_root = state
    for unit in block.modules():
        if unit is not block and isinstance(unit, FSDPModule):
            unit.unshard()  # gathered here, outside the replay, as the forward's prefetch did
    try:
        with recompute:
            yield
    finally:
        if claimed:
            context.iter_forward_root = None


class CheckpointedBlock(nn.Module):
    """Runs the wrapped block under `torch.utils.checkpoint` (non-reentrant)."""

    def __init__(self, block: nn.Module, *, op_level: bool = False, alternate: bool = False, context_fn=None):
        super().__init__()
        self._checkpoint_wrapped_module = block
        self.op_level, self.alternate = op_level, alternate
        self.context_fn = context_fn  # a policy of the caller's (SP's compiled regather, forja/parallel/regather.py)
        self.register_state_dict_post_hook(_drop_wrapper_name)
        self.register_load_state_dict_pre_hook(_add_wrapper_name)

    def forward(self, *args, **kwargs):
        extra = {"context_fn": self.context_fn} if self.context_fn is not None else {}
        if self.op_level:
            # Compiled, the checkpoint is traced from the policy's two modes (all torch.compile
            # takes); eager, the replay also runs inside FSDP's forward root (`_within_forward_root`).
            compiled = torch.compiler.is_compiling()
            extra["context_fn"] = (functools.partial(_op_level_context, self.alternate) if compiled
                                   else functools.partial(_eager_op_level_context, self, self.alternate))
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False,
                          preserve_rng_state=False, **extra, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # attention, feed_forward, ...: reach through to the block
            return getattr(self._modules["_checkpoint_wrapped_module"], name)


_INNER = "_checkpoint_wrapped_module."


def _drop_wrapper_name(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + _INNER)]:
        state_dict[prefix + key[len(prefix + _INNER):]] = state_dict.pop(key)


def _add_wrapper_name(module, state_dict, prefix, *_args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _INNER)]:
        state_dict[prefix + _INNER + key[len(prefix):]] = state_dict.pop(key)


def apply_ac(model: nn.Module, cfg: ParallelConfig) -> None:
    """Wrap the blocks of `model.layers` as `parallel.ac` says."""
    if cfg.ac == "none":
        return
    for index, (name, block) in enumerate(list(model.layers.items())):
        if cfg.ac == "full":
            wrapped = CheckpointedBlock(block)
        elif cfg.ac_every > 0:
            if index % cfg.ac_every:
                continue
            wrapped = CheckpointedBlock(block)
        else:
            wrapped = CheckpointedBlock(block, op_level=True, alternate=cfg.ac_matmuls == "alternate")
        model.layers[name] = wrapped


__all__ = ["CheckpointedBlock", "apply_ac"]
