"""Normalization layers.

RMSNorm computes in float32 whatever the input dtype (as Llama's reference and
Hugging Face do): the mean of squares of bf16 activations loses too much precision.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension.

    `fused`: through forja.ops.rms_norm (one Triton kernel on CUDA, this code elsewhere)."""

    def __init__(self, dim: int, eps: float = 1e-5, *, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from forja.ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with parameters created empty: `init_weights` fills them."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)

    def reset_parameters(self) -> None:
        # Called by nn.LayerNorm.__init__; initialization belongs to init_weights(seed).
        pass
