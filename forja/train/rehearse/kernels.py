"""The attention kernel a GPU would run, for a rehearsal's fake tensors.

On the CPU path, `F.scaled_dot_product_attention` with a value head narrower than the
query's (latent attention: DeepSeek's 192-wide queries and keys, 128-wide values) falls
back to the math kernel, which saves the (T, T) softmax of every head: memory a GPU run
never holds. A GPU takes the memory-efficient kernel, which saves the output and one
log-sum-exp a row. While a rehearsal runs, that case calls the memory-efficient kernel's
op directly (its fake implementation gives the shapes, its derivative the backward); every
other call is torch's own.

The fused loss checks its target ids with a value read on a CPU (a GPU asserts on the device
and reads nothing): on fake tensors it takes the GPU's way (`device_checked_targets`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from forja.ops import cross_entropy


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    sdpa = F.scaled_dot_product_attention

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        narrower_values = q.shape[-1] != v.shape[-1]
        if isinstance(q, FakeTensor) and narrower_values and attn_mask is None and not enable_gqa and not dropout_p:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, q.requires_grad, is_causal=is_causal, scale=scale)
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
