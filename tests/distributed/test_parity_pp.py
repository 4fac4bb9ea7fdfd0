"""Pipeline-parallel layouts reproduce the single-process losses and validation losses (CPU,
Gloo, fp32), and their checkpoints resume under other layouts and the other way round.

The reference is the untied debug Llama (`untied_reference_run`; see PP_COMMON). The
measured differences are printed (pytest -s) and recorded in docs/parallelism.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import forja.parallel
from forja.versions import torch_version
from tests.distributed.parity import PARITY_TOL, PP_COMMON, layout_losses, max_difference
from tests.integration.conftest import losses, read_metrics

PP2 = {**PP_COMMON, "parallel.pp": "2"}
V_SCHEDULES = ("zero-bubble", "dualpipev")
# Before 2.12, V schedules start with a send from a rank to itself, which Gloo cannot do.
OLD_TORCH_V = pytest.mark.skipif(torch_version() < (2, 12), reason="V schedules on Gloo need torch >= 2.12")
TP_LANDED = (Path(forja.parallel.__file__).parent / "tp.py").exists()


def _schedule(name: str) -> dict[str, str]:
    return {"parallel.pp_schedule": f'"{name}"'}


def _val_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run) if "val_loss" in r}


def _check(name: str, reference: Path, run: Path, *, validation: bool = True) -> None:
    """Training losses within PARITY_TOL of the reference's, and validation losses too when
    `validation` (only without data parallelism: train.val_batches counts per dp rank, so
    dp ranks together validate on more batches than one process)."""
    diff = max_difference(losses(reference), losses(run))
    message = f"parity {name}: max |loss diff| = {diff:.2e}"
    if validation:
        ref_val, val = _val_losses(reference), _val_losses(run)
        assert sorted(val) == sorted(ref_val) == [5, 10]
        val_diff = max(abs(ref_val[s] - val[s]) for s in ref_val)
        message += f", max |val loss diff| = {val_diff:.2e}"
        assert val_diff < PARITY_TOL, message
    print(message)
    assert diff < PARITY_TOL, message


@pytest.mark.parametrize("schedule", [
    "1f1b", "gpipe", "interleaved-1f1b",
    pytest.param("zero-bubble", marks=OLD_TORCH_V), pytest.param("dualpipev", marks=OLD_TORCH_V),
])
def test_pp2_schedule_matches_single_process(schedule, tmp_path, train_data, untied_reference_run):
    # 8 sequences in micro-batches of 2: 4 microbatches over 2 (or 4, two per rank) stages.
    layout_losses(tmp_path / "run", train_data, 2, **PP2, **_schedule(schedule))
    _check(f"PP 2 ({schedule})", untied_reference_run, tmp_path / "run")


@pytest.mark.skipif(not TP_LANDED, reason="tensor parallelism (forja/parallel/tp.py) has not landed yet")
def test_pp2_x_tp2_matches_single_process(tmp_path, train_data, untied_reference_run):
    # Sequence parallelism (the default) hands later stages a (B, T/tp, dim) slice.
    layout_losses(tmp_path / "run", train_data, 4, **PP2, **{"parallel.tp": "2"})
    _check("PP 2 x TP 2 (1f1b, SP)", untied_reference_run, tmp_path / "run")


def _resume_from_step_5(run: Path, data: Path, nproc: int, **changes: str) -> None:
    """Drop the step-10 checkpoint and train steps 6-10 again under another layout."""
    shutil.rmtree(run / "checkpoints" / "step-00000010")
    logged = {r["step"]: r["time"] for r in read_metrics(run) if "loss" in r}
    layout_losses(run, data, nproc, **changes)
    relogged = {r["step"]: r["time"] for r in read_metrics(run) if "loss" in r}
    assert relogged[5] == logged[5] and relogged[6] != logged[6]  # it resumed at step 5


def test_pp2_x_fsdp2_matches_and_resumes_under_fsdp4(tmp_path, train_data, untied_reference_run):
    run = tmp_path / "run"
    layout_losses(run, train_data, 4, **PP2)  # pp 2 x dp_shard 2, 1f1b
    _check("PP 2 x FSDP 2 (1f1b)", untied_reference_run, run, validation=False)
    _resume_from_step_5(run, train_data, 4, **PP_COMMON)
    _check("PP 2 x FSDP 2 -> FSDP 4 from step 5", untied_reference_run, run, validation=False)


@OLD_TORCH_V
def test_single_process_checkpoint_resumes_under_pp2_zero_bubble(tmp_path, train_data, untied_reference_run):
    # Two stages per rank: each part takes its own blocks out of the whole model's checkpoint.
    run = tmp_path / "run"
    shutil.copytree(untied_reference_run, run)
    _resume_from_step_5(run, train_data, 2, **PP2, **_schedule("zero-bubble"))
    _check("1 process -> PP 2 (zero-bubble) from step 5", untied_reference_run, run)
