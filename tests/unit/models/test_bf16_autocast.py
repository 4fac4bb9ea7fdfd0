"""Every family's debug flavors train under bf16 autocast on a CPU (`train.precision = "bf16"`):
forward and backward run (a reference kernel with no bf16 form, such as the triangular solve of
Kimi Delta Attention's chunked rule, would stop here), and the loss stays near float32's."""

from __future__ import annotations

import math

import pytest
import torch

from forja.models import build_model
from forja.models.registry import FAMILIES

CASES = [(f, fl) for f, spec in sorted(FAMILIES.items()) for fl in spec.flavors if fl.startswith("debug")]


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_a_training_step_runs_under_bf16_autocast(family, flavor):
    model = build_model(family, flavor, seed=0).train()
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    with torch.no_grad():
        fp32 = model(tokens, labels=labels).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels=labels)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert math.isfinite(loss.item()) and grads and all(torch.isfinite(g).all() for g in grads)
    assert loss.item() == pytest.approx(fp32, abs=0.05)  # bf16 rounding, not another computation
