"""`forja plan` over every registered family: its debug flavor and its smallest published
one plan on 8 H100s without error, and a published flavor ranks at least one layout that
fits (the memory model knows every kind of block the families build)."""

from __future__ import annotations

import pytest

from forja.models import model_args
from forja.models.registry import FAMILIES
from forja.plan.hardware import get_hardware
from forja.plan.job import Job
from forja.plan.planner import plan
from forja.plan.shape import model_shape


def smallest_published(family: str) -> str:
    """The published flavor with the fewest parameters (by dim x layers: no model is built)."""
    flavors = {name: f for name, f in FAMILIES[family].flavors.items() if not name.startswith("debug")}
    return min(flavors, key=lambda n: flavors[n].get("dim", 1) ** 2 * flavors[n].get("n_layers", 1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_plans_on_8_h100s(family):
    hw = get_hardware("h100")
    # A family with no published flavor yet (every family has one now) plans its debug flavor only.
    published = any(not name.startswith("debug") for name in FAMILIES[family].flavors)
    for flavor, must_fit in (("debug", False),) + (((smallest_published(family), True),) if published else ()):
        args = model_args(family, flavor)
        seq = 4096
        job = Job(shape=model_shape(args, seq), seq_len=seq, global_batch_size=16, gpu=True, bf16=True)
        ranked = plan(job, hw, 8)
        assert ranked, f"{family} {flavor}: no layout enumerated"
        # Every prediction is a finite number of bytes, and the fitting ones are ranked first.
        assert all(0 < c.memory.total < 1e15 and c.memory.activations >= 0 for c in ranked)
        if must_fit:
            assert ranked[0].fits, f"{family} {flavor}: {ranked[0].why_not}"
