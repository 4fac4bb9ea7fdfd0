"""Where a layer computes in float32 whatever the model's dtype (a router's scores, a norm's
statistics, a recurrent scan's state): bf16 and fp16 inputs go up to float32, float32 stays
as it is, and float64 stays float64. A float64 model then computes every piece in float64,
which lets its logits be compared with a reference's to ~1e-15 (tests/unit/models), and a
float32 or bf16 model computes exactly what a `.float()` would have.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for a half-precision `dtype` (or float32), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x cast up to float32 where it is narrower; x itself when float32 or float64."""
    return x.to(compute_dtype(x.dtype))
