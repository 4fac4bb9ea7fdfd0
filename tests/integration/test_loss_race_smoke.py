"""bench/loss_race.py at a tiny size: the default and speedrun recipes (and a switch alone) train
in one process, the one evaluator scores each on the held-out windows as it trains, and the race
is computed. No timing or loss level is asserted: bench/RESULTS.md has the measured race."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import loss_race  # noqa: E402


def test_the_race_trains_each_recipe_and_scores_it_on_held_out_windows(tmp_path, train_data):
    only = f"{loss_race.DEFAULT},{loss_race.SPEEDRUN},default + qk-norm"
    sets = [f"data.path={json.dumps(str(train_data))}", 'model.flavor="debug"', "train.seq_len=64",
            "schedule.warmup_steps=1"]
    argv = ["--steps", "3", "--eval-every", "2", "--windows", "2", "--ablate", "--only", only,
            "--out", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    result = loss_race.main(argv)
    rows = result["contenders"]
    assert set(rows) == set(only.split(",")), rows.keys()
    for name, row in rows.items():
        steps = [e["step"] for e in row["evals"]]
        assert steps == [0, 2, 3], (name, steps)  # scored before training, every 2 steps and at the end
        assert all(math.isfinite(e["loss"]) for e in row["evals"]), row
        assert row["tokens"] == 3 * 8 * 64 and row["train_s"] > 0
        assert math.isfinite(row["loss_at_default_time"])
    race = result["race"]
    assert race["target"] == rows[loss_race.DEFAULT]["final_loss"] and race["cost_per_step"] > 0
    assert (tmp_path / "loss_race.md").read_text().startswith(result["meta"]["date"])
