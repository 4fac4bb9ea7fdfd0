"""Rotary position embeddings (RoPE), with linear (position interpolation), Llama 3.1's and
YaRN's frequency scaling.

Convention: the head dimension is split in two halves, and pair i is
(x[i], x[i + d/2]) -- the "rotate half" layout of GPT-NeoX and Hugging Face. Using it
here means Hugging Face Llama weights load without permuting wq/wk.

References: Su et al. 2021 (RoFormer); Llama 3 (Dubey et al. 2024) for the scaling,
which divides low frequencies by `factor`, keeps high ones, and interpolates between;
YaRN (Peng et al. 2023, arXiv 2309.00071), as DeepSeek-V2/V3 use it, which does the same
with bounds counted in rotations over the original context and also rescales attention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from forja.errors import ForjaError

# The rotation itself is the fused op's reference implementation; it lives with the op
# (ops know nothing of models) and is re-exported here for the model code.
from forja.ops.rope import apply_rope

__all__ = ["ROPE_NAMES", "ROPE_TYPES", "LinearScaling", "RopeScaling", "YarnScaling", "apply_rope", "rope_cos_sin",
           "rope_frequencies", "rope_scaling_from", "rope_scaling_from_hf", "rope_scaling_to_hf", "yarn_from_hf",
           "yarn_mscale"]


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

    def rope_scale(self) -> float:
        """The factor on cos and sin: none (Llama 3's rule rescales frequencies only)."""
        return 1.0

    def softmax_scale(self, scale: float) -> float:
        """The attention's softmax scale, unchanged."""
        return scale


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


@dataclass(kw_only=True)
class LinearScaling:
    """Position interpolation (`rope_type = "linear"`, Chen et al. 2023): every frequency
    divided by `factor`, as if positions were."""

    factor: float = 2.0
    """Context extension ratio."""

    def rope_scale(self) -> float:
        return 1.0

    def softmax_scale(self, scale: float) -> float:
        return scale


ROPE_TYPES: dict[str, type] = {"linear": LinearScaling, "llama3": RopeScaling, "yarn": YarnScaling}
"""Hugging Face's `rope_type` of each scaling forja computes; "default" means plain RoPE."""
ROPE_NAMES = "'default', 'linear', 'llama3' and 'yarn'"

Scaling = RopeScaling | YarnScaling | LinearScaling
_HF_NAMES = {"original_max_position_embeddings": "original_max_seq_len"}  # config.json's spelling -> ours


def rope_scaling_from(value: Any, *, key: str = "model.rope_scaling", default: str = "llama3") -> Scaling | None:
    """A scaling from a config value: None, a RopeScaling/YarnScaling, or a table like Hugging
    Face's, {rope_type = "yarn", factor = 8.0, original_max_seq_len = 4096} ("llama3" or "yarn";
    "default" is plain RoPE, None; a table without rope_type is `default`'s kind). Field names
    are the dataclasses' (original_max_position_embeddings is read as original_max_seq_len).
    A bad table stops with one sentence naming `key` and the fix."""
    if value is None or isinstance(value, tuple(ROPE_TYPES.values())):
        return value
    if not isinstance(value, dict):
        raise ForjaError(f"{key} = {value!r} must be a table such as {{rope_type = \"yarn\", factor = 8.0, "
                         "original_max_seq_len = 4096}")
    fields = {_HF_NAMES.get(k, k): v for k, v in value.items() if k not in ("rope_type", "type")}
    kind = value.get("rope_type", value.get("type")) or _kind_of(fields, default)
    if kind == "default":
        return None
    cls = ROPE_TYPES.get(kind)
    if cls is None:
        raise ForjaError(f"{key}.rope_type = {kind!r} is not one forja computes; use \"llama3\" (Llama 3's rule), "
                         "\"yarn\", \"linear\" (position interpolation) or \"default\" (plain RoPE)")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ForjaError(f"{key}.{unknown[0]} is not a field of rope_type {kind!r}; its fields: {', '.join(names)}")
    try:
        scaling = cls(**fields)
    except TypeError as exc:
        raise ForjaError(f"{key}: {exc}") from None
    _check(scaling, key)
    return scaling


def _kind_of(fields: dict, default: str) -> str:
    """The rope_type a table without one names by its fields (a checkpoint's recorded args are
    the dataclass's fields), else `default`."""
    only = {kind: {f.name for f in dataclasses.fields(cls)} for kind, cls in ROPE_TYPES.items()}
    for kind, names in only.items():
        others = set().union(*(n for k, n in only.items() if k != kind))
        if set(fields) & (names - others):
            return kind
    return default


def _check(s: Scaling, key: str) -> None:
    numbers = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in ("truncate",)}
    bad = [k for k, v in numbers.items() if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if bad:
        raise ForjaError(f"{key}.{bad[0]} = {numbers[bad[0]]!r} must be a number")
    original = getattr(s, "original_max_seq_len", 1)
    if not s.factor >= 1 or original < 1:
        raise ForjaError(f"{key}: factor = {s.factor} must be >= 1 (the context's growth) and original_max_seq_len "
                         f"= {original} the pre-training length, >= 1")
    if isinstance(s, RopeScaling) and not 0 < s.low_freq_factor < s.high_freq_factor:
        raise ForjaError(f"{key}: low_freq_factor = {s.low_freq_factor} and high_freq_factor = {s.high_freq_factor} "
                         "need 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4)")
    if isinstance(s, YarnScaling) and not 0 < s.beta_slow < s.beta_fast:
        raise ForjaError(f"{key}: beta_slow = {s.beta_slow} and beta_fast = {s.beta_fast} need "
                         "0 < beta_slow < beta_fast (YaRN: 1 and 32)")


def rope_scaling_to_hf(s: Scaling) -> dict:
    """config.json's `rope_scaling` (transformers 4.x dialect, which 5.x reads) of a scaling."""
    if isinstance(s, LinearScaling):
        return {"rope_type": "linear", "factor": s.factor}
    if isinstance(s, RopeScaling):
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}
    out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
    if s.attention_factor is not None:
        out["attention_factor"] = s.attention_factor
    out.update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim") if getattr(s, k)})
    return out


def rope_scaling_from_hf(rope: dict | None, max_len: int, *, where: str = "config.json") -> Scaling | None:
    """A scaling from config.json's `rope_scaling` or `rope_parameters` (None or "default":
    plain RoPE), with transformers' defaults for absent keys (`max_len`: max_position_embeddings)."""
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ForjaError(f"{where}: rope type {kind!r} is not supported; forja reads {ROPE_NAMES}")
    if kind == "linear":
        return LinearScaling(factor=float(rope["factor"]))
    original = int(rope.get("original_max_position_embeddings") or max_len)
    if kind == "llama3":
        return RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]), original_max_seq_len=original)
    return yarn_from_hf(rope, max_len, original)


def yarn_from_hf(rope: dict, max_len: int | None, original: int) -> YarnScaling:
    """YaRN from a config.json rope dict, transformers' defaults for absent keys: the original
    context `original` where the dict names none, a factor of max_len / original (1 when
    config.json names no max_position_embeddings, `max_len` None)."""
    original = int(rope.get("original_max_position_embeddings") or original)
    attention_factor = rope.get("attention_factor")
    return YarnScaling(
        factor=float(rope.get("factor") or (max_len or original) / original), original_max_seq_len=original,
        beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(rope.get("truncate", True)))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: Scaling | None = None) -> torch.Tensor:
    """Inverse frequencies, float32, shape (head_dim // 2,)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return _scale_yarn(theta**exponents, head_dim, theta, scaling)
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
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

