"""What `forja plan` accepts, `forja train`'s preflight accepts: every candidate of a recipe
whose replica groups ([ft]) split the global batch, and of a recipe whose sequence length
grows on a schedule, run through the whole preflight (data, layout, memory) by the recipe and
the candidate's `--set` line, as a user would launch it on the same CPU ranks.

Before the one request, the planner searched with the whole global batch and train.seq_len
alone: it ranked layouts the preflight then refused (a group's share too small for the
micro-batch, HSDP beside the replica groups, a cp degree that does not split an early length).
"""

from __future__ import annotations

import dataclasses

import pytest

from forja.config import load_config
from forja.errors import ForjaError
from forja.parallel.config import PP_SCHEDULES
from forja.plan.cli import set_items
from forja.plan.job import job_from_config
from forja.plan.planner import default_space, plan
from forja.train.launch.preflight import Preflight, device_hardware

from .conftest import base_overrides

WORLD = 4  # ranks of one job (under [ft]: of one replica group)

RECIPES = {
    "[ft]: 2 replica groups split the global batch": {
        "ft.enabled": "true", "ft.groups": "2", "train.global_batch_size": "16", "train.micro_batch_size": "2"},
    "train.seq_len_schedule: 20 tokens, then 64": {
        "train.seq_len_schedule": "[[0, 20], [4, 64]]", "train.global_batch_size": "8",
        "train.micro_batch_size": "2"},
}


def _preflight(overrides: list[str], layout=None, *, memory: bool = True) -> Preflight:
    sets = overrides + (set_items(layout) if layout is not None else [])
    if not memory:
        sets.append('parallel.memory_check="off"')
    return Preflight(load_config("debug", sets), world_size=WORLD, device_type="cpu", ranks_here=WORLD)


@pytest.mark.parametrize("name", RECIPES)
def test_every_layout_the_planner_accepts_passes_the_preflight(name, tmp_path, train_data):
    overrides = base_overrides(tmp_path / "run", train_data, **RECIPES[name])
    hw = device_hardware("cpu", ranks_here=WORLD)  # the preflight's own device, memory included
    # Context parallelism and every schedule searched too: the lengths and batches they split.
    space = dataclasses.replace(default_space(hw), allow_cp=True, pp_schedules=PP_SCHEDULES)
    ranked = plan(job_from_config(_preflight(overrides).cfg, gpu=False), hw, WORLD, space=space)
    runs = [c for c in ranked if c.runs]
    assert len(runs) > 10 and any(c.fits for c in runs)
    for c in runs:  # the run's whole preflight; a layout that runs but does not fit without the memory check
        _preflight(overrides, c.layout, memory=c.fits).run()
    refused = [c for c in ranked if not c.runs]
    assert refused  # the planner refuses some (a share or a length they cannot split), each as train does
    for c in refused:
        with pytest.raises(ForjaError):
            _preflight(overrides, c.layout).run()
