"""`--quantize int8` of a mixture of experts (forja/models/quantize.py): the routed experts'
stacked weights become int8 per expert and output channel, and the model's logits stay close
to the unquantized model's."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_model
from forja.models.common.moe import GroupedExperts, RouterGate
from forja.models.quantize import Int8Experts, cast, int8_per_channel, quantize

pytest.importorskip("torchao")

# Largest logit error over the largest logit: int8 rounds each weight to 1/254 of its channel's
# largest, about 0.2% relative; the errors of 3 MoE layers add up (measured: printed below).
LOGIT_TOL = 2e-2


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
               if ".experts." in name and "shared" not in name)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))


def test_int8_per_channel_rounds_each_channel_to_its_own_scale():
    w = torch.randn(3, 5, 16) * torch.logspace(-3, 1, 5)[None, :, None]  # channels of very different size
    q, scale = int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (3, 5) and int(q.abs().max()) == 127
    error = (q.float() * scale[..., None] - w).abs().amax(-1)  # (3, 5)
    assert bool((error <= scale / 2 + 1e-12).all())  # half a step of each channel's own scale


def test_moe_experts_are_stored_in_int8_and_logits_stay_close(tokens):
    model = build_model("qwen3", "debug-moe", seed=0).eval()
    with torch.no_grad():
        reference = model(tokens)  # (B, T, V)
    bf16_bytes = _expert_bytes(cast(build_model("qwen3", "debug-moe", seed=0), "bfloat16"))
    shapes = {n: (m.w1.shape, m.w2.shape) for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    assert len(shapes) == 3  # debug-moe: layer 0 is dense
    quantize(model, "int8")
    for name, (w1_shape, w2_shape) in shapes.items():
        experts = model.get_submodule(name)
        assert isinstance(experts, Int8Experts)
        assert experts.w1.dtype == experts.w3.dtype == experts.w2.dtype == torch.int8
        assert experts.w1.shape == w1_shape and experts.w2.shape == w2_shape
        assert experts.w1_scale.shape == w1_shape[:2] and experts.w2_scale.shape == w2_shape[:2]
    # The router stays in full precision: its top-k picks are sensitive to rounding.
    gates = [m for m in model.modules() if isinstance(m, RouterGate)]
    assert gates and all(type(g.weight) is torch.nn.Parameter for g in gates)
    int8_bytes = _expert_bytes(model)  # fp32 scales here: the model was not cast
    int8_bf16_bytes = _expert_bytes(quantize(cast(build_model("qwen3", "debug-moe", seed=0), "bfloat16"), "int8"))
    with torch.no_grad():
        logits = model(tokens)
    error = float((logits - reference).abs().max() / reference.abs().max())
    print(f"experts: bf16 {bf16_bytes:,} B, int8 {int8_bf16_bytes:,} B ({int8_bf16_bytes / bf16_bytes:.3f}x); "
          f"logits' largest error over the largest logit {error:.2e}")
    assert int8_bf16_bytes <= 0.52 * bf16_bytes and int8_bytes < 0.55 * bf16_bytes
    assert 0 < error < LOGIT_TOL
