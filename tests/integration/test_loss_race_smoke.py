"""bench/loss_race.py at a tiny size: the default and speedrun recipes (and a switch alone) train
in one process, the peers' recipes (nanoGPT's over transformers' GPT-2, torchtitan's llama3 from
its side environment) each in their own on the same rows, the one evaluator scores each on the
held-out windows as it trains, and the race is computed. No timing or loss level is asserted:
bench/RESULTS.md has the measured race."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import loss_race  # noqa: E402


def test_the_race_trains_each_recipe_and_scores_it_on_held_out_windows(tmp_path, train_data):
    only = (f"{loss_race.DEFAULT},{loss_race.SPEEDRUN},default + qk-norm,default + value embeddings (2 tables),"
            f"{loss_race.NANOGPT},{loss_race.TITAN}")
    sets = [f"data.path={json.dumps(str(train_data))}", 'model.flavor="debug"', "train.seq_len=64",
            "schedule.warmup_steps=1"]
    argv = ["--steps", "3", "--eval-every", "2", "--windows", "2", "--ablate", "--peers", "--only", only,
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
    rows_file = torch.load(tmp_path / "rows.pt", weights_only=True)
    assert rows_file.shape == (3 * 8, 65)  # the default recipe's 3 steps of 8 rows, each inputs + last label
    nanogpt, titan = rows[loss_race.NANOGPT]["settings"], rows[loss_race.TITAN]["settings"]
    assert nanogpt["recipe"].startswith("nanoGPT train_shakespeare_char: learning_rate 0.001"), nanogpt
    assert "its llama3 recipe's over 3 steps" in titan["lr_schedule"] and titan["torchtitan"] == "0.3.0", titan
    assert "retain" in nanogpt["host"] and "retain" in titan["host"]  # forja's host settings for the peers too
    race = result["race"]
    assert race["target"] == rows[loss_race.DEFAULT]["final_loss"] and race["cost_per_step"] > 0
    assert (tmp_path / "loss_race.md").read_text().startswith(result["meta"]["date"])


def test_the_speedrun_cost_bench_times_every_variant_in_turn():
    import speedrun_cost

    medians = speedrun_cost.main(["--rounds", "1", "--set", 'model.flavor="debug"', "--set", "train.seq_len=32"])
    assert list(medians) == list(speedrun_cost.VARIANTS) and all(s > 0 for s in medians.values())
