"""Sequence parallelism's gathered inputs, kept split until backward (Megatron-LM's scheme).

Under sequence parallelism a block's sublayer gathers its (B, T/tp, D) input into the whole
(B, T, D) sequence before its column-parallel matmuls (the plan's `PrepareModuleInput`), and
those matmuls keep the gathered tensor for their weights' gradients: tp times the bytes of the
split input it was made from, in every block, until the block's backward. For a GPT of
hidden size 16,384 on TP 8 x PP 8 that is 21 GiB of a first stage's 76. Megatron-LM keeps
only the split input and gathers it again in backward (Korthikanti et al. 2022, section
4.2.2); so does forja here: saved-tensor hooks around the sublayer's forward pack any saved
tensor that is the gathered input, or a view of it, as the split input, and unpack it by
gathering again. One more all-gather per sublayer in backward buys the memory back.

A compiled block's graph decides what it keeps (hooks cannot run inside it), and inductor's
partitioner never recomputes a collective unless an activation-checkpoint policy asks: there
the block runs under a selective checkpoint whose policy prefers to recompute the gathers and
the views and concatenations that reassemble them, and to save everything else, so the
partitioner keeps what it would have kept but the gathered input (`regather_policy`).

Only for blocks activation checkpointing leaves whole (a checkpointed block keeps what its
policy saves and gathers again when it recomputes), and where the matmuls read the gathered
tensor itself: not under autocast over an fp32 residual stream (each matmul keeps its own bf16
cast) nor with float8's gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from forja.parallel.config import ParallelConfig

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional
# The ops that make a sequence-gathered input from the split one: the collective, its wait, and
# the views, splits and concatenations that move the gathered rows to the sequence dimension.
_GATHERING = {_c10d.all_gather_into_tensor.default, _c10d.wait_tensor.default, _aten.cat.default,
              _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default, _aten.slice.Tensor,
              _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


def _prefer_regathering(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in _GATHERING else CheckpointPolicy.PREFER_SAVE


def regather_policy():
    """A compiled block's selective-checkpoint context: recompute the gathers, save the rest."""
    return create_selective_checkpoint_contexts(_prefer_regathering)


def regathers(cfg: ParallelConfig, *, tp: int, sequence_parallel: bool, float8: bool) -> bool:
    """Whether blocks AC leaves whole keep their sequence-gathered inputs split until backward:
    under TP with sequence parallelism, eager or compiled by inductor, without float8's gathers.
    The one decision forja.parallel applies and forja.plan prices."""
    return (tp > 1 and sequence_parallel and not float8
            and (not cfg.compile or cfg.compile_backend == "inductor"))


def gathers_sequence(style: ParallelStyle | None) -> bool:
    """Whether `style` (or the style a forja wrapper applies after its own) gathers a
    module's first input from sequence-split to whole."""
    while style is not None and not isinstance(style, PrepareModuleInput):
        style = getattr(style, "then", None)
    return (style is not None and bool(style.input_layouts) and style.input_layouts[0] == Shard(1)
            and style.desired_input_layouts[0] == Replicate())


def regather_in_backward(module: nn.Module, mesh: DeviceMesh) -> None:
    """Keep `module`'s gathered first input split until backward (module docstring). Its
    gather must already be registered: the hooks go around it."""
    hooks = _Regather(mesh)
    module.register_forward_pre_hook(hooks.see_split, prepend=True)  # before the gather
    module.register_forward_pre_hook(hooks.enter)  # after it: the gathered input is args[0]
    module.register_forward_hook(hooks.leave)


class _Split:
    """A sublayer's split input, and its whole gathered again while the saved tensors made
    from it are unpacked in backward: one all-gather serves every matmul that read it (the
    attention's q, k and v projections read one input), then the whole tensor is let go."""

    def __init__(self, split: DTensor):
        self.split = split
        self.packed = 0  # saved tensors packed from it and not yet unpacked
        self.whole: torch.Tensor | None = None

    def gathered(self) -> torch.Tensor:
        if self.whole is None:
            with torch.no_grad():
                self.whole = self.split.redistribute(self.split.device_mesh, [Replicate()]).to_local()  # (B, T, D)
        whole = self.whole
        self.packed -= 1
        if self.packed <= 0:
            self.whole = None
        return whole


@dataclass
class _Packed:
    """A saved tensor that was the gathered input (or a view of it), held as the split input."""

    source: _Split
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # storage offset within the gathered tensor


class _Regather:
    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.split: _Split | None = None
        self.gathered: DTensor | None = None
        self.context: saved_tensors_hooks | None = None

    def see_split(self, module: nn.Module, args) -> None:
        x = args[0].detach()  # (B, T/tp, D)
        self.split = _Split(x if isinstance(x, DTensor) else DTensor.from_local(x, self.mesh, [Shard(1)],
                                                                                  run_check=False))

    def enter(self, module: nn.Module, args) -> None:
        gathered = args[0]
        usable = isinstance(gathered, DTensor) and gathered._local_tensor.is_contiguous()
        self.gathered = gathered if usable else None
        self.context = saved_tensors_hooks(self.pack, self.unpack)
        self.context.__enter__()

    def leave(self, module: nn.Module, args, output):
        self.context.__exit__(None, None, None)
        self.context = self.split = self.gathered = None
        return output

    def pack(self, t: torch.Tensor):
        g = self.gathered
        if g is None or not isinstance(t, DTensor) or (t is not g and t._base is not g):
            return t
        local = t._local_tensor
        self.split.packed += 1
        return _Packed(self.split, local.size(), local.stride(),
                       local.storage_offset() - g._local_tensor.storage_offset())

    @staticmethod
    def unpack(saved):
        if not isinstance(saved, _Packed):
            return saved
        whole = saved.source.gathered()
        view = whole.as_strided(saved.size, saved.stride, whole.storage_offset() + saved.offset)
        return DTensor.from_local(view, saved.source.split.device_mesh, [Replicate()], run_check=False)
