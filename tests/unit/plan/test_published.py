"""forja plan against published runs (bench/plan_published.py, docs/planner.md): each
published layout fits, and its tokens/s per GPU is predicted within 25%."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from plan_published import RUNS, predict  # noqa: E402


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_published_layout_fits_and_its_speed_is_predicted_within_25_percent(run):
    own, _ = predict(run)
    assert own.fits, own.why_not
    assert own.tokens_per_sec_per_device / run.published == pytest.approx(1.0, abs=0.25)
