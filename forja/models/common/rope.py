"""Rotary position embeddings (RoPE), with Llama 3.1's and YaRN's frequency scaling.

Convention: the head dimension is split in two halves, and pair i is
(x[i], x[i + d/2]) -- the "rotate half" layout of GPT-NeoX and Hugging Face. Using it
here means Hugging Face Llama weights load without permuting wq/wk.

References: Su et al. 2021 (RoFormer); Llama 3 (Dubey et al. 2024) for the scaling,
which divides low frequencies by `factor`, keeps high ones, and interpolates between;
YaRN (Peng et al. 2023, arXiv 2309.00071), as DeepSeek-V2/V3 use it, which does the same
with bounds counted in rotations over the original context and also rescales attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The rotation itself is the fused op's reference implementation; it lives with the op
# (ops know nothing of models) and is re-exported here for the model code.
from forja.ops.rope import apply_rope

__all__ = ["RopeScaling", "YarnScaling", "apply_rope", "rope_cos_sin", "rope_frequencies", "yarn_mscale"]


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


@dataclass(kw_only=True)
class YarnScaling:
    """YaRN frequency scaling (`rope_type = "yarn"` in Hugging Face configs), with
    DeepSeek's mscale fields."""

    factor: float = 40.0
    """Context extension ratio: the lowest frequencies are divided by it."""
    original_max_seq_len: int = 4096
    """Context length the model was pre-trained with before scaling."""
    beta_fast: float = 32.0
    """Dimensions turning more than beta_fast times over the original context keep their frequency."""
    beta_slow: float = 1.0
    """Dimensions turning fewer than beta_slow times are fully divided by `factor`."""
    mscale: float = 0.0
    """With mscale_all_dim: cos and sin are multiplied by yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim); 0 means not given."""
    mscale_all_dim: float = 0.0
    """DeepSeek's MLA multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim)^2;
    0 means not given."""
    attention_factor: float | None = None
    """Multiplier of cos and sin, overriding the one derived from mscale; None: derived."""
    truncate: bool = True
    """Round the interpolation ramp's bounds outward to whole dimensions."""

    def rope_scale(self) -> float:
        """The factor on cos and sin (so on the rotated part of every q . k score, squared).
        Without both mscales, YaRN's 0.1 ln(factor) + 1."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale(self, scale: float) -> float:
        """DeepSeek's latent attention's softmax `scale` times yarn_mscale(factor,
        mscale_all_dim)^2 (unchanged without mscale_all_dim), multiplied in Hugging Face's
        order so the result is bit-equal."""
        if not self.mscale_all_dim:
            return scale
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return scale * m * m


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None) -> torch.Tensor:
    """Inverse frequencies, float32, shape (head_dim // 2,)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _scale_yarn(theta**exponents, head_dim, theta, scaling)
    return _scale_llama3(inv_freq, scaling)


def _yarn_dim(rotations: float, head_dim: int, theta: float, context: int) -> float:
    """The (fractional) dimension whose wavelength fits `rotations` times in `context`."""
    return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _scale_yarn(wavelength_base: torch.Tensor, head_dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """YaRN's blend of the original frequencies (high ones: many rotations over the original
    context) and the ones divided by `factor` (low ones), linear over the dimensions between.
    `wavelength_base` is theta ** (2i / head_dim), float32. The arithmetic follows Hugging
    Face's `_compute_yarn_parameters` step for step, so the frequencies are bit-equal."""
    low = _yarn_dim(s.beta_fast, head_dim, theta, s.original_max_seq_len)
    high = _yarn_dim(s.beta_slow, head_dim, theta, s.original_max_seq_len)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one dimension: avoid dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # (hd/2,): 1 = keep the original frequency, 0 = divide it by factor
    original = 1.0 / wavelength_base
    stretched = 1.0 / (s.factor * wavelength_base)
    return stretched * (1 - keep) + original * keep


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


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` (T,), each (T, head_dim), float32, multiplied by
    `scale` (YaRN's `rope_scale`, 1 otherwise)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd): both halves of a pair share an angle
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()

