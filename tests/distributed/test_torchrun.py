"""The trainer under torchrun: two CPU processes (Gloo, FSDP over 2 ranks) train the same
model on the same global batches as one process, so the losses match."""

from __future__ import annotations

from forja.cli import main
from tests.distributed.parity import PARITY_TOL
from tests.integration.conftest import forja_process, losses, train_args


def test_two_processes_match_one(tmp_path, train_data):
    steps = {"train.steps": "8", "parallel.timeout_s": "60"}
    single = tmp_path / "single"
    assert main(train_args(single, train_data, **steps)) == 0
    double = tmp_path / "fsdp2"
    proc = forja_process(train_args(double, train_data, **steps) + ["--nproc", "2"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    a, b = losses(single), losses(double)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    diff = max(abs(a[s] - b[s]) for s in a)
    print(f"FSDP 2 vs 1 process: max |loss difference| over 8 steps = {diff:.2e}")
    assert diff < PARITY_TOL
    # A checkpoint written by 2 ranks resumes in 1 process (DCP reshards it), and continues
    # as the single-process run does.
    more = {**steps, "train.steps": "10"}
    assert main(train_args(double, train_data, **more)) == 0
    assert main(train_args(single, train_data, **more)) == 0
    c, d = losses(single), losses(double)
    assert max(abs(c[s] - d[s]) for s in (9, 10)) < PARITY_TOL
