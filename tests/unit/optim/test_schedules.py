"""Per-group learning-rate schedules (`schedule.groups`)."""

import pytest

from forja.errors import ForjaError
from forja.optim.config import ScheduleConfig


def test_a_group_can_warm_up_and_decay_by_its_own_keys():
    import torch

    from forja.optim.schedules import build_scheduler

    matrix, vector = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [matrix], "name": "matrices"}, {"params": [vector], "name": "vectors"}], lr=1.0)
    cfg = ScheduleConfig(name="cosine", warmup_steps=4, groups={"vectors": {"warmup_steps": 0, "name": "constant"}})
    sched = build_scheduler(opt, cfg, total_steps=10)
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert [m for m, _ in seen][:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # the matrices warm up
    assert [v for _, v in seen] == [1.0] * 6  # the vectors hold their peak from the start


def test_schedule_groups_name_unknown_keys_and_groups():
    import torch

    from forja.optim.schedules import build_scheduler

    with pytest.raises(ForjaError, match="schedule.groups.adamw has no schedule key 'warmup'"):
        ScheduleConfig(groups={"adamw": {"warmup": 3}})
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "name": "vectors"}], lr=1.0)
    message = "'muon', which is not a parameter group of this optimizer; its groups: vectors"
    with pytest.raises(ForjaError, match=message):
        build_scheduler(opt, ScheduleConfig(groups={"muon": {"warmup_steps": 0}}), 10)
