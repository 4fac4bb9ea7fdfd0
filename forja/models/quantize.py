"""Weight-only int8 for inference (`forja generate/eval --quantize int8`), through torchao.

Every nn.Linear's weight becomes int8 with one float scale per output channel (symmetric);
activations stay in the model's dtype, and each matmul dequantizes on the fly. The token
embedding and the norms are left as they are. So the Linear weights take half the bytes of
bf16 (a quarter of fp32) plus their scales, and the whole model shrinks by less the larger
its embedding's share (docs/evaluation.md has what was measured).
"""

from __future__ import annotations

import io

import torch
from torch import nn

from forja.errors import ForjaError

QUANTIZE_CHOICES = ("none", "int8")


def quantize(model: nn.Module, how: str) -> nn.Module:
    """`model` with its Linear weights quantized as `how` ("none" or "int8"), in place."""
    if how == "none":
        return model
    if how not in QUANTIZE_CHOICES:
        raise ForjaError(f"--quantize {how!r}: choose one of {', '.join(QUANTIZE_CHOICES)}")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise ForjaError("--quantize int8 runs through torchao: pip install 'forja[float8]'") from exc
    quantize_(model, Int8WeightOnlyConfig())
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as saved (a quantized tensor's int8 data and scales included)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()
