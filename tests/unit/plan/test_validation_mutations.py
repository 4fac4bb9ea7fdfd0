"""The validation criteria have teeth: break one term of the speed model, a gross error of the
kind a refactor could make, and `validation_failures` (the function test_validation.py holds
the real model to) must report it. Without these, a bound loose enough to pass a model with
matmuls at the datasheet peak, free communication or no pipeline bubble would pass silently
(issue #38: the old median-only check passed all three)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

# Last on the path: bench/ scripts must not shadow installed packages.
sys.path.append(str(Path(__file__).resolve().parents[3] / "bench"))

from plan_published import results, validation_failures  # noqa: E402

from forja.plan import speed  # noqa: E402


def _failures_under(monkeypatch, **replacements) -> list[str]:
    for name, value in replacements.items():
        assert hasattr(speed, name), name  # a renamed function must not turn the mutation into a no-op
        monkeypatch.setattr(speed, name, value)
    return validation_failures(results())


def test_matmuls_at_the_datasheet_peak_fail_the_validation(monkeypatch):
    failures = _failures_under(monkeypatch, matmul_efficiency=lambda *args, **kwargs: 1.0)
    assert failures, "a model with every matmul at 100% of peak passed the validation"
    # Every row speeds up: the criteria on the whole table catch it (measured: bias +0.55, the
    # best source, Megatron-LM, at 0.32).
    assert any(f.startswith(("bias", "no source within 25%")) for f in failures), failures


def test_free_communication_fails_the_validation(monkeypatch):
    # Every collective: rings (TP, CP, FSDP, HSDP), all-to-alls (EP, CP), and the point-to-point
    # sends whose time is bytes over a link's bandwidth (PP, the CP ring's hops).
    failures = _failures_under(monkeypatch, ring_time=lambda *args, **kwargs: 0.0,
                               all_to_all_time=lambda *args, **kwargs: 0.0,
                               link_bandwidth=lambda *args, **kwargs: math.inf)
    assert failures, "a model where all communication is free passed the validation"
    # Measured: the 20 communication-bound rows' median |log ratio| 0.35 -> 0.61.
    assert any(f.startswith("communication-bound rows") for f in failures), failures


def test_no_pipeline_bubble_fails_the_validation(monkeypatch):
    failures = _failures_under(monkeypatch, bubble_fraction=lambda *args, **kwargs: 0.0)
    assert failures, "a model without a pipeline bubble passed the validation"
    # Only pipelined rows change: their own criterion catches it (measured: torchtitan's 405B
    # 1F1B row +0.42 -> +1.03).
    assert any(f.startswith("pipeline row") for f in failures), failures
