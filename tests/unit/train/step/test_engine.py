"""The step engine on one process: a step is the mean loss's gradient step, a non-finite
step leaves the weights alone, and `microbatch_loss` is where a loss term enters."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from forja.models import model_args
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.optim.config import OptimConfig, ScheduleConfig
from forja.parallel import ParallelConfig
from forja.train.build import build_model_parts
from forja.train.step.build import build_engine
from forja.train.step.engine import StepEngine


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor


def _engine(dims, cls=None, grad_clip=1.0):
    args = model_args("llama", "debug", n_layers=2)
    parts = build_model_parts(args, dims, ParallelConfig(), device=torch.device("cpu"), seed=0).parts
    optimizers = OptimizerGroup(parts, OptimConfig(lr=1e-2))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0), 10)
    kwargs = dict(device=torch.device("cpu"), grad_clip=grad_clip, document_mask=True)
    if cls is None:
        return build_engine(parts, None, optimizers, scheduler, dims, precision="fp32", **kwargs)
    return cls(parts, optimizers, scheduler, dims, compute_dtype=None, **kwargs)


def _batches(n: int = 2) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (n, 2, 33), generator=gen)
    docs = torch.zeros(2, 32, dtype=torch.long)
    return [Batch(t[:, :-1], t[:, 1:], docs) for t in tokens]


def test_a_step_reports_the_mean_loss_and_moves_the_weights(dims):
    engine = _engine(dims)
    batches = _batches()
    with torch.no_grad():
        expected = sum(engine.eval_loss(b) for b in batches) / len(batches)
    before = engine.model.tok_embeddings.weight.detach().clone()
    out = engine.train_step(batches)
    assert not out.skipped and out.tokens == 2 * 2 * 32 and out.lr == pytest.approx(1e-2)
    assert out.loss == pytest.approx(expected.item(), abs=1e-6)  # the mean over the micro-batches
    assert out.grad_norm > 0
    assert not torch.equal(before, engine.model.tok_embeddings.weight)


def test_a_non_finite_step_leaves_the_weights_alone(dims):
    engine = _engine(dims)
    with torch.no_grad():
        engine.model.norm.weight[0] = float("nan")  # every logit, and so the loss, becomes NaN
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out = engine.train_step(_batches())
    assert out.skipped
    for name, p in engine.model.named_parameters():
        assert torch.allclose(before[name], p, rtol=0, atol=0, equal_nan=True), name
        assert p.grad is None, name  # the bad gradients are dropped


class _PlusOne(StepEngine):
    def microbatch_loss(self, loss: torch.Tensor, n: int) -> torch.Tensor:
        return super().microbatch_loss(loss, n) + 1.0 / n  # an auxiliary term of 1 per step


def test_microbatch_loss_is_where_a_loss_term_enters(dims):
    plain, extra = _engine(dims, grad_clip=0.0), _engine(dims, _PlusOne, grad_clip=0.0)
    a, b = plain.train_step(_batches()), extra.train_step(_batches())
    assert b.loss == pytest.approx(a.loss + 1.0, abs=1e-6)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)  # a constant has no gradient
