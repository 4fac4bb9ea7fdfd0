"""Rotary position embeddings (RoPE), with Llama 3.1's frequency scaling.

Convention: the head dimension is split in two halves, and pair i is
(x[i], x[i + d/2]) -- the "rotate half" layout of GPT-NeoX and Hugging Face. Using it
here means Hugging Face Llama weights load without permuting wq/wk.

References: Su et al. 2021 (RoFormer); Llama 3 (Dubey et al. 2024) for the scaling,
which divides low frequencies by `factor`, keeps high ones, and interpolates between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The rotation itself is the fused op's reference implementation; it lives with the op
# (ops know nothing of models) and is re-exported here for the model code.
from forja.ops.rope import apply_rope

__all__ = ["RopeScaling", "apply_rope", "rope_cos_sin", "rope_frequencies"]


@dataclass(kw_only=True)
class RopeScaling:
    """Llama 3.1 frequency scaling (`rope_type = "llama3"` in Hugging Face configs)."""

    factor: float = 8.0
    """Divisor applied to wavelengths longer than original_max_seq_len / low_freq_factor."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_seq_len / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_seq_len / high_freq_factor are left alone."""
    original_max_seq_len: int = 8192
    """Context length the model was pre-trained with before scaling."""


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies, float32, shape (head_dim // 2,)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    return _scale_llama3(inv_freq, scaling)


def _scale_llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = s.original_max_seq_len / s.low_freq_factor
    short_wavelen = s.original_max_seq_len / s.high_freq_factor
    # Weight of the unscaled frequency: 1 for short wavelengths, 0 for long ones, linear in
    # (context / wavelength) in between.
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > long_wavelen, inv_freq / s.factor, inv_freq)
    middle = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(middle, blended, out)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` (T,), each (T, head_dim), float32."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd): both halves of a pair share an angle
    return angles.cos(), angles.sin()

