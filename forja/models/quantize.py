"""Weight-only int8 for inference (`forja generate/eval --quantize int8`), through torchao.

Every nn.Linear's weight becomes int8 with a float scale (and zero point) per output channel;
activations stay in the model's dtype, and each matmul dequantizes on the fly. The token
embedding and the norms are left as they are, and so is an output projection tied to the
embedding: quantizing it would store a second, int8 copy of the shared weight beside the
embedding. So the Linear weights take half the bytes of bf16 (a quarter of fp32) plus their
scales, and the whole model shrinks by less the larger its embedding's share; cast the model
to bf16 first (`--dtype bfloat16`) for the rest to take bf16's bytes (docs/evaluation.md has
what was measured).
"""

from __future__ import annotations

import io

import torch
from torch import nn

from forja.errors import ForjaError

QUANTIZE_CHOICES = ("none", "int8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cast(model: nn.Module, dtype: str | None) -> nn.Module:
    """`model` in `dtype` (a DTYPES name), or as it is for None: for inference, before `quantize`."""
    if dtype is None:
        return model
    if dtype not in DTYPES:
        raise ForjaError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return model.to(DTYPES[dtype])


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
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear)
              and not (tied and fqn == "output"))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as saved (a quantized tensor's int8 data and scales included)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()
