"""Weight-only int8 for inference (`forja generate/eval --quantize int8`), through torchao.

Every nn.Linear's weight becomes int8 with a float scale (and zero point) per output channel;
activations stay in the model's dtype, and each matmul dequantizes on the fly. The token
embedding and the norms are left as they are, and so is an output projection tied to the
embedding: quantizing it would store a second, int8 copy of the shared weight beside the
embedding. So the Linear weights take half the bytes of bf16 (a quarter of fp32) plus their
scales, and the whole model shrinks by less the larger its embedding's share; cast the model
to bf16 first (`--dtype bfloat16`) for the rest to take bf16's bytes (docs/evaluation.md has
what was measured).

A mixture of experts' routed experts are stacked 3-D weights (forja/models/common/moe.py's
GroupedExperts: (experts, out, in)), which torchao's Linear path does not see: they become
`Int8Experts`, int8 per expert and per output channel (symmetric, a scale of the weights'
dtype each), dequantized expert by expert inside its matmul (x @ q^T, then times the output
channels' scales), so no full-precision copy of a layer's experts is ever made. The router's
gate stays in full precision: its top-k picks are sensitive to rounding and it is small.
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from forja.errors import ForjaError
from forja.models.common.moe import GroupedExperts, RouterGate, gated_activation

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
    quantize_experts(model)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear)
              and not isinstance(m, RouterGate) and not (tied and fqn == "output"))
    return model


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of w (..., out, in) per output channel: (q (..., out, in) int8, scale
    (..., out) in w's dtype), w ~ q * scale[..., None]."""
    absmax = w.detach().float().abs().amax(-1)  # (..., out)
    scale = (absmax / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w.detach().float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


class Int8Experts(nn.Module):
    """GroupedExperts with int8 weights (buffers w1, w3 (n, H, D), w2 (n, D, H), and their
    scales w1_scale, w3_scale (n, H), w2_scale (n, D)), for inference: no gradients."""

    def __init__(self, experts: GroupedExperts):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name)
            if weight is None:  # experts without a gate (Nemotron-H's squared ReLU) have no w3
                self.register_buffer(name, None)
                continue
            if isinstance(weight, DTensor):
                raise ForjaError("--quantize int8 quantizes the routed experts of a model on one device; "
                                 "this one's are sharded (expert parallelism): load it whole first")
            q, scale = int8_per_channel(weight)
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)
        # Expert biases (gpt-oss) stay in full precision, as the biases of quantized Linears do.
        for name in ("b1", "b2", "b3"):
            bias = getattr(experts, name, None)
            self.register_buffer(name, None if bias is None else bias.detach().clone())
        self.activation = (experts.activation, experts.limit, experts.alpha)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, D) rows sorted by expert, counts (n,) rows per expert -> (M, D)."""
        sizes = counts.tolist()
        out = []
        for g, rows in enumerate(x.split(sizes)):
            if sizes[g]:
                up = None if self.w3 is None else self._linear(rows, "w3", g)
                h = gated_activation(self._linear(rows, "w1", g), up, *self.activation)  # (m, H)
                out.append(self._linear(h, "w2", g))  # (m, D)
        return torch.cat(out) if out else x.new_zeros(0, self.w2.shape[1])

    def _linear(self, x: torch.Tensor, name: str, g: int) -> torch.Tensor:
        # x @ (q * s)^T = (x @ q^T) * s: the scales multiply the output channels after the matmul.
        y = F.linear(x, getattr(self, name)[g].to(x.dtype))
        y = y * getattr(self, f"{name}_scale")[g].to(y.dtype)
        bias = getattr(self, "b" + name[1])
        return y if bias is None else y + bias[g].to(y.dtype)


def quantize_experts(model: nn.Module) -> int:
    """Replace every GroupedExperts of `model` by its Int8Experts, in place; how many were."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    for name, experts in found:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Int8Experts(experts))
    return len(found)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as saved (a quantized tensor's int8 data and scales included)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()
