"""forja's "at least float32" casts (forja/models/common/precision.py) and the float64
comparisons' scoped lift of transformers' float32 casts (tests/unit/models/float64_casts.py)."""

from __future__ import annotations

import torch

from forja.models.common.precision import at_least_fp32
from tests.unit.models.float64_casts import _kept


def test_at_least_fp32_widens_half_precision_and_keeps_float64():
    x = torch.ones(3, dtype=torch.float32)
    assert at_least_fp32(x) is x  # float32 computes exactly as `.float()` did
    assert at_least_fp32(x.bfloat16()).dtype == torch.float32
    assert at_least_fp32(x.double()).dtype == torch.float64


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _outer(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    softmax = torch.softmax(x, -1, dtype=torch.float32)
    listed = [t.to(torch.float32) for t in (x,)][0]  # a comprehension's own code object
    return x.float(), x.type(torch.float32), softmax, listed, _inner(x)


def test_only_the_named_functions_own_casts_keep_float64():
    x = torch.ones(2, 3, dtype=torch.float64)
    *own, nested = _kept(_outer)(x)
    assert all(t.dtype == torch.float64 for t in own)
    assert nested.dtype == torch.float32  # `_inner` is not named: its cast runs as written
    assert _kept(_outer)(x.float())[0].dtype == torch.float32  # float32 inputs are left alone
    assert all(t.dtype == torch.float32 for t in _outer(x))  # and outside the wrapper nothing changes
