"""bench/calibrate.py runs on a CPU (a tiny run) and prints its tables: every GEMM of a layer
in its three passes, attention, the copy, each with a measured rate and the model's figure."""

from __future__ import annotations

import sys
from pathlib import Path

# Last on the path: bench/ scripts must not shadow installed packages.
sys.path.append(str(Path(__file__).resolve().parents[3] / "bench"))

import calibrate  # noqa: E402


def test_tiny_calibration_prints_one_row_per_kernel_with_measured_rates(capsys):
    calibrate.main(["--tiny", "--no-collectives"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    kernels = [r for r in rows if r[0].lstrip("| ").split(" ")[0] in ("qkv", "wo", "w1+w3", "w2", "output")]
    assert len(kernels) == 15  # 5 GEMMs x forward, input grad, weight grad
    assert all(float(r[2]) >= 0 and float(r[3]) >= 0 for r in kernels)
    assert any(float(r[2]) > 0 for r in kernels)
    assert any(r[0].startswith("| causal SDPA") for r in rows)
    copy = next(r for r in rows if r[0] == "| copy")
    assert float(copy[2].split()[0]) > 0
