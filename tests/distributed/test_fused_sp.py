"""The fused ops run their Triton kernels under tensor + sequence parallelism.

Sequence parallelism hands RMSNorm DTensors split along the sequence; the op runs its kernel
on each rank's rows (forja/ops/dispatch.py, `local_shards`) instead of falling back to the
PyTorch reference. Run on CPU by Triton's interpreter (TRITON_INTERPRET=1, FORJA_OPS=triton
in the launched processes' environment: it must be set before triton is imported): the run
records no fallback (a DTensor the kernels could not take would be one) and its losses match
the reference path's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from forja.cli import main
from tests.integration.conftest import losses, train_args

pytest.importorskip("triton")

STEPS = 2
# One block and one micro-batch of 2 x 32 tokens a step: the interpreter runs every program of
# every kernel in Python (about 4 s a step on 2 CPU ranks).
FUSED = {"train.steps": str(STEPS), "train.global_batch_size": "2", "train.micro_batch_size": "2",
         "model.overrides": "{n_layers=1}",
         "train.val_interval": "0", "train.sample_tokens": "0", "checkpoint.interval": "0",
         "parallel.timeout_s": "240", "train.seq_len": "32", "model.fused_ops": "true"}
TP_SP = {"parallel.tp": "2", "parallel.dp_shard": "1", "parallel.sequence_parallel": "true"}
TOL = 1e-5  # the bound; measured: printed below (pytest -s)


def _interpreted_run(run, data) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "1", "FORJA_OPS": "triton"}
    args = train_args(run, data, **FUSED, **TP_SP) + ["--nproc", "2"]
    done = subprocess.run([sys.executable, "-m", "forja", *args], env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done.stdout + done.stderr


def test_fused_ops_take_their_kernels_on_sequence_parallel_shards(tmp_path, train_data):
    reference = tmp_path / "reference"  # one process, the PyTorch references of the same ops
    assert main(train_args(reference, train_data, **FUSED)) == 0
    run = tmp_path / "run"
    out = _interpreted_run(run, train_data)
    launch = json.loads((run / "run.json").read_text())["launches"][-1]
    assert launch["fallbacks"] == [], launch["fallbacks"]
    assert "forja: fallback:" not in out
    want, got = losses(reference), losses(run)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    diff = max(abs(want[s] - got[s]) for s in want)
    print(f"TP 2 + SP, fused ops interpreted vs one process' references: max |loss diff| = {diff:.2e}")
    assert diff < TOL
