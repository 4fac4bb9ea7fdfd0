"""`train.precision = "fp16"` end to end on CPU (float16 autocast runs there): the debug model
trains, an initial loss scale far too large makes the first steps overflow (skipped, the
scale halving at each, no anomaly), and the scale survives a resume."""

from __future__ import annotations

import math

from forja.cli import main
from forja.train.step.scaler import LossScaler

from .conftest import forja_process, read_metrics, train_args

# Half the usual batch (2 micro-batches of 2): float16 autocast on a CPU is slow, and what is
# tested (overflows, the scale, the pipeline's agreement) does not need more.
COMMON = {"train.precision": '"fp16"', "train.val_interval": "0", "train.sample_tokens": "0",
          "checkpoint.interval": "4", "train.global_batch_size": "4", "train.micro_batch_size": "2"}


def _steps(run) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


def test_fp16_trains_the_debug_model_close_to_fp32(tmp_path, train_data):
    fp16, fp32 = tmp_path / "fp16", tmp_path / "fp32"
    assert main(train_args(fp16, train_data, **COMMON)) == 0
    assert main(train_args(fp32, train_data, **{**COMMON, "train.precision": '"fp32"'})) == 0
    half, full = _steps(fp16), _steps(fp32)
    assert [r["step"] for r in half] == list(range(1, 13))
    assert all(r["overflow"] == 0.0 and r["loss_scale"] == 65536.0 and math.isfinite(r["grad_norm"]) for r in half)
    assert half[-1]["loss"] < half[0]["loss"] - 0.5
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(half, full)]
    assert 0 < max(diffs) < 0.05  # really float16 matmuls, and still the same training


def _expected_scales(records: list[dict], scaler: LossScaler) -> list[float]:
    """The scale each step should have run with, replaying the logged overflows."""
    scales = []
    for r in records:
        scales.append(scaler.scale)
        scaler.update(overflow=r["overflow"] == 1.0)
    return scales


def test_overflows_are_skipped_halve_the_scale_and_the_scale_is_resumed(tmp_path, train_data):
    run = tmp_path / "run"
    init, interval = 2.0 ** 24, 3  # 2**24 overflows the debug model's float16 gradients
    changes = {**COMMON, "train.fp16_init_scale": str(init), "train.fp16_growth_interval": str(interval),
               "train.steps": "12"}
    assert main(train_args(run, train_data, **changes)) == 0
    first = _steps(run)
    overflowed = [r["step"] for r in first if r["overflow"] == 1.0]
    assert overflowed[:2] == [1, 2] and len(overflowed) < 12  # overflows first, then it trains
    for r in first:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) != (r["overflow"] == 1.0), r
    scaler = LossScaler(init, interval)
    assert [r["loss_scale"] for r in first] == _expected_scales(first, scaler)
    assert first[-1]["overflows"] == len(overflowed)
    # Overflows are the scaler's business: no anomaly event, no skipped_steps counted.
    assert not any("event" in r or "skipped_steps" in r for r in read_metrics(run))

    assert main(train_args(run, train_data, **{**changes, "train.steps": "14"})) == 0  # resumes at step 12
    resumed = [r for r in _steps(run) if r["step"] > 12]
    assert [r["step"] for r in resumed] == [13, 14]
    assert scaler.scale != init and resumed[0]["loss_scale"] == scaler.scale
    assert resumed[0]["overflows"] >= len(overflowed)



def test_a_two_stage_pipeline_overflows_and_trains_as_one_process(tmp_path, train_data):
    """The pipeline scales each micro-batch's loss on its last stage; the global norm tells
    every stage of an overflow on any. Two Gloo ranks (pp = 2) against one process."""
    changes = {**COMMON, "train.fp16_init_scale": str(2.0 ** 24), "train.steps": "8", "checkpoint.interval": "0",
               "parallel.timeout_s": "120"}
    assert main(train_args(tmp_path / "one", train_data, **changes)) == 0
    proc = forja_process(train_args(tmp_path / "pp", train_data, **{**changes, "parallel.pp": "2"}) + ["--nproc", "2"])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    one, pp = _steps(tmp_path / "one"), _steps(tmp_path / "pp")
    assert [r["overflow"] for r in pp] == [r["overflow"] for r in one] and one[0]["overflow"] == 1.0
    assert [r["loss_scale"] for r in pp] == [r["loss_scale"] for r in one]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one, pp)) < 1e-4


def test_fp16_with_bf16_fsdp_parameters_stops_before_any_write(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{**COMMON, "parallel.mixed_precision": '"bf16"'})) != 0
    assert "set parallel.mixed_precision = 'fp32'" in capsys.readouterr().err
    assert not run.exists()
