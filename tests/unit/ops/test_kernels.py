"""The Triton kernels of rms_norm, rope and swiglu match their PyTorch references, forward
and backward, under Triton's interpreter on CPU.

The kernels run in one child process (interpret_checks.py: TRITON_INTERPRET must be set
before triton is imported); each test here checks one case of what it reported.

Tolerances, as the largest error over the largest reference value:
- float32: 1e-5 (measured: at most 2e-7; only the order of float32 sums differs);
- bfloat16: 1e-2, and at least 99% of elements equal to the bit when the interpreter rounds
  float32 -> bfloat16 as a GPU does (measured: 100%, forward and backward, every op: the
  kernels round where eager PyTorch rounds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.ops.interpret_checks import CASES

pytest.importorskip("triton")  # a test dependency; absent only where no triton wheel exists

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
BF16_BIT_EQUAL = 0.99
FUSED_FUNCTIONS = {"rms_norm": "_RMSNormFunctionBackward", "rope": "_RopeFunctionBackward",
                   "swiglu": "_SwiGLUFunctionBackward"}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "FORJA_OPS": "triton"}
    done = subprocess.run([sys.executable, "-m", "tests.unit.ops.interpret_checks"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_forcing_triton_runs_kernels_on_cpu_tensors(interpreted):
    assert interpreted["use_triton_cpu"] is True


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(interpreted, case):
    op, dtype, _ = CASES[case]
    # The fused autograd Function made the output: the comparison is kernel against reference.
    assert interpreted["paths"][case] == FUSED_FUNCTIONS[op]
    measured = interpreted["cases"][case]
    for quantity, m in measured.items():
        assert m["rel_err"] <= TOLERANCE[dtype], (case, quantity, m)
        if dtype == "bfloat16" and interpreted["exact_bf16_rounding"]:
            assert m["bit_equal"] >= BF16_BIT_EQUAL, (case, quantity, m)
