"""Normalization layers.

RMSNorm computes in float32 whatever the input dtype (as Llama's reference and
Hugging Face do): the mean of squares of bf16 activations loses too much precision. A
float64 input stays float64 (forja/models/common/precision.py).
"""

from __future__ import annotations

import torch
from torch import nn

from forja.models.common.precision import at_least_fp32


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension.

    `fused`: through forja.ops.rms_norm (one Triton kernel on CUDA, this code elsewhere).
    `zero_centered`: the weight is stored as its offset from one, y = x_hat * (1 + weight),
    multiplied in float32 before the cast back (Gemma, Qwen3.5, Qwen3-Next): weight decay then
    pulls the scale towards one, not zero. Initialize such a weight to zeros."""

    def __init__(self, dim: int, eps: float = 1e-5, *, fused: bool = False, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused and not zero_centered  # the kernel multiplies by the stored weight
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from forja.ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = at_least_fp32(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (x * (1.0 + self.weight.to(x.dtype))).to(dtype)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"norm": "zero_centered" if self.zero_centered else "rms"}


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with parameters created empty: `init_weights` fills them."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)

    def reset_parameters(self) -> None:
        # Called by nn.LayerNorm.__init__; initialization belongs to init_weights(seed).
        pass

    def structure_fields(self) -> dict:
        return {"norm": "layer"}
