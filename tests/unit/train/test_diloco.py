"""DiLoCo's outer loop (forja/train/ft/diloco.py) in one process: the fragment schedule, one sync
by hand against the Nesterov formula, a sync that does not commit, and its state round trip."""

from __future__ import annotations

import torch
from torch import nn

from forja.train.ft.config import FTConfig
from forja.train.ft.diloco import OuterLoop, split_fragments


class _Done:
    def wait(self) -> None:
        pass


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))


def _drifted(by: float) -> tuple[nn.Module, OuterLoop]:
    """A model whose weights moved `by` since its DiLoCo loop (2 inner steps) took them as global."""
    model = _model()
    loop = OuterLoop(FTConfig(enabled=True, mode="diloco", inner_steps=2), [model])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return model, loop


def test_fragments_are_contiguous_runs_of_about_equal_size():
    params = list(_model().named_parameters())
    cuts = split_fragments(params, 2)
    assert [n for cut in cuts for n, _ in cut] == [n for n, _ in params]  # model order, each once
    sizes = [sum(p.numel() for _, p in cut) for cut in cuts]
    assert sizes == [40, 90]  # 1.weight (64) is past the middle of 130 by its own middle: fragment 1
    assert split_fragments(params, 1) == [params]


def test_each_fragment_syncs_in_turn_delay_steps_after_its_start():
    loop = OuterLoop(FTConfig(enabled=True, mode="streaming-diloco", inner_steps=4, fragments=2,
                              fragment_sync_delay=1), [_model()])
    assert loop.period == 2
    assert [loop.due(s) for s in range(0, 9)] == [None, 0, None, 1, None, 0, None, 1, None]
    plain = OuterLoop(FTConfig(enabled=True, mode="diloco", inner_steps=3), [_model()])
    assert [plain.due(s) for s in range(0, 7)] == [None, None, None, 0, None, None, 0]


def test_a_sync_takes_a_nesterov_step_on_the_averaged_drift_and_resets_the_local_weights():
    model = _model()
    loop = OuterLoop(FTConfig(enabled=True, mode="diloco", inner_steps=2, outer_lr=0.7, outer_momentum=0.9), [model])
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # the inner steps' drift
    other = [torch.full_like(p, -0.3) for p in model.parameters()]  # the other group's drift, as averaged

    def allreduce(t):  # averaged with the other group's (global - local) = -0.3
        t.add_(other.pop(0)).div_(2)
        return _Done()

    loop.start(0, 2, allreduce)
    assert loop.apply_if_due(1, lambda: True) is None  # not its step
    assert loop.apply_if_due(2, lambda: True) is True
    for p, s in zip(model.parameters(), start, strict=True):
        delta = (-0.1 + -0.3) / 2  # the average of (global - local) over the two groups
        expected = s - 0.7 * (delta + 0.9 * delta)  # Nesterov with a zero momentum: g + m * (m * 0 + g)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    assert loop.syncs == 1 and loop.bytes_sent == 4 * sum(p.numel() for p in model.parameters())


def test_a_sync_that_does_not_commit_keeps_the_local_progress_and_the_global_weights():
    model, loop = _drifted(0.5)
    drifted = [p.detach().clone() for p in model.parameters()]
    before = loop.state_dict()
    loop.start(0, 2, lambda t: _Done())
    assert loop.apply_if_due(2, lambda: False) is False
    assert all(torch.equal(p, d) for p, d in zip(model.parameters(), drifted, strict=True))
    assert all(torch.equal(v, before[k]) for k, v in loop.state_dict().items())
    assert loop.failed == 1 and loop.in_flight is None


def test_the_global_weights_and_momenta_round_trip_through_a_state_dict():
    model, loop = _drifted(0.2)
    loop.start(0, 2, lambda t: _Done())
    loop.apply_if_due(2, lambda: True)
    saved = {k: v.clone() for k, v in loop.state_dict().items()}
    assert any(k.startswith("momentum.") and v.abs().sum() > 0 for k, v in saved.items())
    fresh = OuterLoop(FTConfig(enabled=True, mode="diloco", inner_steps=2), [_model()])
    fresh.load_state_dict(saved)
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
