"""fp16 with dynamic loss scaling: the scaler's rules (halve and skip on overflow, grow after
a clean interval, checkpointed state), and the step engine using it on one CPU process
(float16 autocast runs on CPU): an overflow is skipped and is not the guard's business, a
clean step reports unscaled values."""

from __future__ import annotations

import math

import pytest
import torch

from forja.errors import ForjaError
from forja.models import model_args
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.optim.config import OptimConfig, ScheduleConfig
from forja.parallel import ParallelConfig
from forja.parallel.checks import LayoutRequest, check_layout
from forja.train.build import build_model_parts
from forja.train.config import TrainConfig
from forja.train.step.build import build_engine
from forja.train.step.engine import StepScales
from forja.train.step.scaler import LossScaler, loss_scaler

from .test_engine import _batches


def test_an_overflow_halves_the_scale_and_resets_the_clean_count():
    scaler = LossScaler(init_scale=1024.0, growth_interval=3)
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    scaler.update(overflow=True)
    assert (scaler.scale, scaler.clean_steps, scaler.overflows) == (512.0, 0, 1)
    scaler.update(overflow=True)
    assert (scaler.scale, scaler.overflows) == (256.0, 2)


def test_the_scale_doubles_after_growth_interval_clean_steps():
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    scales = []
    for _ in range(7):
        scaler.update(overflow=False)
        scales.append(scaler.scale)
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_the_scale_stops_at_one_so_a_real_fault_reaches_the_guard():
    scaler = LossScaler(init_scale=2.0)
    assert scaler.can_back_off()
    scaler.update(overflow=True)
    assert scaler.scale == 1.0 and not scaler.can_back_off()


def test_state_round_trips():
    scaler = LossScaler(init_scale=2.0 ** 20, growth_interval=5)
    for overflow in (True, False, False):
        scaler.update(overflow)
    other = LossScaler(init_scale=1.0, growth_interval=5)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict() == {"scale": 2.0 ** 19, "clean_steps": 2, "overflows": 1}


def test_unscale_divides_gradients_in_place():
    scaler = LossScaler(init_scale=4.0)
    grads = [torch.full((3,), 8.0), torch.full((2, 2), -4.0, dtype=torch.float64)]
    scaler.unscale_(grads)
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.full((2, 2), -1.0,
                                                                                              dtype=torch.float64))


def test_only_fp16_gets_a_scaler_and_the_config_checks_its_keys():
    assert loss_scaler(TrainConfig(precision="bf16")) is None
    scaler = loss_scaler(TrainConfig(precision="fp16", fp16_init_scale=256.0, fp16_growth_interval=7))
    assert (scaler.scale, scaler.growth_interval) == (256.0, 7)
    with pytest.raises(ForjaError, match="train.fp16_init_scale = 1000.0 must be a power of two"):
        TrainConfig(fp16_init_scale=1000.0)
    with pytest.raises(ForjaError, match="train.fp16_growth_interval = 0"):
        TrainConfig(fp16_growth_interval=0)


def _check_fp16(precision: str, float8: str = "none", mixed_precision: str = "fp32") -> None:
    """The layout validator's precision checks, on one process."""
    check_layout(LayoutRequest(args=model_args("llama", "debug"),
                               parallel=ParallelConfig(mixed_precision=mixed_precision),
                               world_size=1, seq_len=64, global_batch_size=8, micro_batch_size=8,
                               precision=precision, float8=float8))


def test_fp16_refuses_bf16_parameters_and_float8_by_name():
    _check_fp16("fp16")  # plain fp16 is fine
    _check_fp16("bf16", float8="tensorwise", mixed_precision="bf16")
    with pytest.raises(ForjaError, match="parallel.mixed_precision = 'bf16' casts FSDP's parameters"):
        _check_fp16("fp16", mixed_precision="bf16")
    with pytest.raises(ForjaError, match="train.float8 = 'rowwise' runs its matmuls in float8"):
        _check_fp16("fp16", float8="rowwise")


def _fp16_engine(dims, init_scale: float):
    args = model_args("llama", "debug", n_layers=2)
    parts = build_model_parts(args, dims, ParallelConfig(), device=torch.device("cpu"), seed=0).parts
    optimizers = OptimizerGroup(parts, OptimConfig(lr=1e-2))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0), 10)
    return build_engine(parts, None, optimizers, scheduler, dims, device=torch.device("cpu"), precision="fp16",
                        grad_clip=1.0, document_mask=True, scaler=LossScaler(init_scale=init_scale))


class _Guard:
    """Records what the engine asked it."""

    def __init__(self):
        self.calls: list[tuple[float, float]] = []

    def __call__(self, loss: float, grad_norm: float) -> bool:
        self.calls.append((loss, grad_norm))
        return False


def test_a_clean_fp16_step_reports_and_judges_unscaled_values(dims):
    scaled, plain = _fp16_engine(dims, 2.0 ** 12), _fp16_engine(dims, 1.0)
    guard = _Guard()
    a, b = scaled.train_step(_batches(), guard=guard), plain.train_step(_batches())
    assert not a.skipped and a.metrics == {"loss_scale": 2.0 ** 12, "overflow": 0.0, "overflows": 0.0}
    assert a.loss == b.loss  # the loss is scaled and unscaled exactly (a power of two)
    assert 0 < a.grad_norm < 100 and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-2)
    assert guard.calls == [(a.loss, a.grad_norm)]
    assert scaled.compute_dtype == torch.float16


def test_an_overflow_is_skipped_without_asking_the_guard_and_halves_the_scale(dims):
    engine = _fp16_engine(dims, 2.0 ** 60)  # far beyond float16's 65504: the gradients overflow
    guard = _Guard()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out = engine.train_step(_batches(), guard=guard)
    assert out.skipped and guard.calls == []  # not the guard's: no anomaly is judged
    assert math.isfinite(out.loss) and not math.isfinite(out.grad_norm)
    assert out.metrics == {"loss_scale": 2.0 ** 60, "overflow": 1.0, "overflows": 1.0}
    assert engine.stateful()["scaler"].scale == 2.0 ** 59  # the engine owns the scale
    for name, p in engine.model.named_parameters():
        assert torch.equal(before[name], p) and p.grad is None, name


def test_a_nan_loss_under_fp16_is_the_guards_and_leaves_the_scale(dims):
    engine = _fp16_engine(dims, 2.0 ** 12)
    guard = _Guard()
    out = engine.train_step(_batches(), guard=guard, scales=StepScales(fault=float("nan")))
    assert out.skipped and len(guard.calls) == 1 and guard.calls[0][0] != guard.calls[0][0]  # NaN
    scaler = engine.stateful()["scaler"]
    assert out.metrics["overflow"] == 0.0 and scaler.scale == 2.0 ** 12 and scaler.clean_steps == 0
