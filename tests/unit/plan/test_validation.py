"""The speed model against published runs (bench/plan_published.py, docs/planner.md): the
table is large and varied enough to mean something, and the model meets every validation
criterion (`validation_failures`: the typical error, the bias, each source, the pipeline rows
whose bubble is material, the rows whose communication is on the critical path). The constants
come from datasheets and microbenchmarks, not from these rows, so this is a check of a
prediction: a change to the model that makes it worse fails here, and no constant may be tuned
to pass it (see docs/planner.md, "Calibration"). test_validation_mutations.py checks that the
criteria have teeth: each fails when a term of the model is broken."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

# Last on the path: bench/ scripts must not shadow installed packages.
sys.path.append(str(Path(__file__).resolve().parents[3] / "bench"))

from plan_published import (  # noqa: E402
    REPOSITORY,
    RUNS,
    SOURCES,
    bubble_bound,
    communication_bound,
    results,
    summary,
    validation_failures,
)


@pytest.fixture(scope="module")
def table():
    return results()


def test_the_table_has_25_expressible_rows_from_4_source_repositories(table):
    assert len(table) >= 25
    repos = {REPOSITORY[r.run.source] for r in table}
    assert len(repos) >= 4, repos
    assert all(r.source in SOURCES for r in RUNS)
    names = [r.name for r in RUNS]
    assert len(names) == len(set(names)), "each published row once"
    # Mixture-of-experts and float8 runs are in it, not only dense bf16 ones.
    assert any(r.run.model.get("model.family") in ("qwen3", "deepseek_v3") for r in table)
    assert sum(r.run.float8 != "none" for r in table) >= 5


def test_the_criteria_subsets_hold_enough_rows_to_mean_something(table):
    # Each subset criterion judges several rows from more than one source, not one run.
    for subset in (bubble_bound, communication_bound):
        rows = [r for r in table if subset(r.run)]
        assert len(rows) >= 5 and len({REPOSITORY[r.run.source] for r in rows}) >= 2, subset.__name__


def test_inexpressible_rows_say_why_and_stay_out_of_the_statistics(table):
    left = [r for r in RUNS if r.inexpressible]
    assert left and all(len(r.inexpressible) > 10 for r in left)
    assert not {r.run.name for r in table} & {r.name for r in left}


def test_the_model_meets_every_validation_criterion(table):
    overall = summary(table)["all"]
    assert overall.rows == len(table) and math.isfinite(overall.worst_abs)
    assert 0 <= overall.within_25 <= overall.within_50 <= 1
    assert validation_failures(table) == []
