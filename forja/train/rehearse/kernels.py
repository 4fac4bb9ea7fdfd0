"""The attention kernel a GPU would run, for a rehearsal's fake tensors.

On the CPU path, `F.scaled_dot_product_attention` with a value head narrower than the
query's (latent attention: DeepSeek's 192-wide queries and keys, 128-wide values) falls
back to the math kernel, which saves the (T, T) softmax of every head: memory a GPU run
never holds. A GPU takes the memory-efficient kernel, which saves the output and one
log-sum-exp a row (and, given a boolean mask, the additive bias CUDA's SDPA converts it to).
While a rehearsal runs, that case calls the memory-efficient kernel's
op directly (its fake implementation gives the shapes, its derivative the backward); every
other call is torch's own.

FlexAttention (sliding windows, attention sinks, packed documents) compiles a Triton kernel,
which a fake tensor cannot run; eager, it would write every (T, T) score out. While a
rehearsal runs, "flex" blocks get a stand-in (`flex_attention_standin`) that holds what
FlexAttention's kernel holds: it saves q, k and v, returns the output and one log-sum-exp a
row, and its backward makes the three gradients. The block mask holds nothing per token.

The fused loss checks its target ids with a value read on a CPU (a GPU asserts on the device
and reads nothing): on fake tensors it takes the GPU's way (`device_checked_targets`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from forja.models.common import attention as attention_module
from forja.ops import cross_entropy


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    sdpa = F.scaled_dot_product_attention

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        narrower_values = q.shape[-1] != v.shape[-1]
        boolean = attn_mask is None or attn_mask.dtype == torch.bool
        if isinstance(q, FakeTensor) and narrower_values and boolean and not enable_gqa and not dropout_p:
            bias = None
            if attn_mask is not None:  # as CUDA's SDPA does: an additive bias in q's dtype, broadcast to every head
                bias = torch.where(attn_mask.logical_not(), float("-inf"), torch.zeros((), dtype=q.dtype))
                bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, q.requires_grad, is_causal=is_causal, scale=scale)
            return out[0]  # (B, H, T, hv)
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


@contextlib.contextmanager
def device_checked_targets() -> Iterator[None]:
    check = cross_entropy._check_target_ids

    def on_device(targets: torch.Tensor, ignore_index: int, vocab: int) -> None:
        if not isinstance(targets, FakeTensor):
            check(targets, ignore_index, vocab)  # a fake tensor has no values to read: nothing to check

    cross_entropy._check_target_ids = on_device
    try:
        yield
    finally:
        cross_entropy._check_target_ids = check


class _FlexHolds(torch.autograd.Function):
    """FlexAttention's memory without its kernel: q (B, H, T, hd), k and v (B, Hkv, T, hd | hv)
    -> out (B, H, T, hv), lse (B, H, T) fp32; the values of a fake tensor do not matter."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def flex_attention_standin() -> Iterator[None]:
    """FlexAttention's blocks on the rehearsal's fake CPU, held as its kernel holds them."""
    devices, block_mask, flex = (attention_module.FLEX_DEVICES, attention_module._flex_block_mask,
                                 attention_module._flex_attention)

    def no_block_mask(document_ids, T, window, device, chunk=None):
        return "rehearsal"  # a block mask is a few int32 per tile: nothing a rank's peak notices

    def standin(q, k, v, block_mask, scale=None, with_lse: bool = False):
        out, lse = _FlexHolds.apply(q, k, v)
        return (out, lse) if with_lse else out

    attention_module.FLEX_DEVICES = (*devices, "cpu")
    attention_module._flex_block_mask, attention_module._flex_attention = no_block_mask, standin
    try:
        yield
    finally:
        attention_module.FLEX_DEVICES = devices
        attention_module._flex_block_mask, attention_module._flex_attention = block_mask, flex
