"""bench/trainer_cost.py at the smoke size: forja's Trainer and its model in a plain loop, built
in one process, both train, are timed in turn and profiled. No timing is asserted
(bench/RESULTS.md has the measured figures); what is checked is that the Trainer runs the same
arithmetic as the bare loop: every matmul and attention call, in the same counts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import trainer_cost  # noqa: E402


def test_the_trainer_runs_the_bare_loops_arithmetic(tmp_path, train_data, capsys):
    out = tmp_path / "cost.json"
    trainer_cost.main(["--size", "smoke", "--rounds", "1", "--warmup", "1", "--json", str(out),
                       "--set", f"data.path={json.dumps(str(train_data))}"])
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"Trainer", "bare loop"}
    assert all(math.isfinite(v) and v > 0 for v in result["ms"].values()), result["ms"]
    heavy = [op for op in result["counts_differ"] if op in ("aten::mm", "aten::addmm", "aten::bmm")
             or "scaled_dot_product" in op or "log_softmax" in op]
    assert not heavy, {op: result["counts_differ"][op] for op in heavy}
    assert "the Trainer's step takes" in capsys.readouterr().out
