"""The rerun of a sampled step (forja/train/step/rerun.py), on one process: runs that agree say
nothing; a fault in one run of the forward or the backward is named and the result a third run
agreed with is the one kept; a rank that never gives the same result twice is not reproducible."""

from __future__ import annotations

import torch
from torch import nn

from forja.train.step.rerun import Rerun, flip_bit, flipped_activation


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({"0": nn.Linear(8, 8), "1": nn.Linear(8, 8)})
        self.dropout = nn.Dropout(0.5)  # the runs must draw the same mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = torch.tanh(block(self.dropout(x)))
        return x.square().mean()


def _rerun(model: _Tiny, faults: dict[int, str]) -> tuple[Rerun, list[int]]:
    """A Rerun of one step of `model`, whose run i (0, 1, 2) meets faults[i]: "gradient",
    "activation", or "gradient+N" (bit FLIPPED_BIT of the N-th parameter's gradient; one flip in two
    elements of one tensor can give the same fingerprint)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    runs: list[int] = []

    def one_pass(first: bool) -> torch.Tensor:
        i = len(runs)
        runs.append(i)
        model.zero_grad(set_to_none=True)
        fault = faults.get(i, "")
        with flipped_activation(model if fault == "activation" else None):
            loss = model(x)
            loss.backward()
        if fault.startswith("gradient"):
            flip_bit(list(model.parameters())[int(fault.partition("+")[2] or 0)].grad)
        return loss

    grads = lambda: [p.grad for p in model.parameters()]  # noqa: E731
    return Rerun(one_pass, grads, list(model.layers.values()), torch.device("cpu")), runs


def _clean_grads() -> list[torch.Tensor]:
    model = _Tiny()
    rerun, _ = _rerun(model, {})
    rerun.run()
    return [p.grad.clone() for p in model.parameters()]


def test_runs_that_agree_are_run_twice_and_say_nothing():
    model = _Tiny()
    rerun, runs = _rerun(model, {})
    _, verdict = rerun.run()
    assert verdict is None and runs == [0, 1]


def test_a_flipped_gradient_in_the_first_run_is_named_and_the_agreeing_result_kept():
    model = _Tiny()
    rerun, runs = _rerun(model, {0: "gradient"})
    _, verdict = rerun.run()
    assert runs == [0, 1, 2] and verdict.reproducible
    assert verdict.text.startswith("the gradients of rank 0 differed")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), _clean_grads()))


def test_a_flipped_activation_is_named_as_the_forward():
    model = _Tiny()
    rerun, _ = _rerun(model, {1: "activation"})  # in the rerun: the third run agrees with the first
    _, verdict = rerun.run()
    assert verdict.reproducible and verdict.text.startswith("the forward (its blocks' outputs) of rank 0")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), _clean_grads()))


def test_three_different_results_are_not_reproducible():
    model = _Tiny()
    rerun, _ = _rerun(model, {0: "gradient+0", 1: "gradient+1", 2: "gradient+2"})
    _, verdict = rerun.run()
    assert not verdict.reproducible and "rank 0 gave different results in three runs" in verdict.text


def test_a_fault_in_the_third_run_alone_leaves_a_bad_result_held():
    model = _Tiny()
    rerun, _ = _rerun(model, {0: "gradient", 2: "gradient+3"})
    assert rerun.run()[1].reproducible is False  # the first two differ and the third agrees with neither
