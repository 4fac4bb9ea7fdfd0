"""bench/peers.py at a tiny size: forja, the plain Hugging Face loop and torchtitan (its pinned
release, installed by the harness into a side environment over this one's torch) all build, train
on the same token rows and answer a round; the ratios come out. No timing is asserted: speed is
measured by the benchmark itself (bench/RESULTS.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ONLY = "forja eager,forja model alone (bare loop),HF loop eager,torchtitan eager"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_harness_runs_every_framework_and_computes_the_ratios(tmp_path, train_data):
    out = tmp_path / "peers"
    cmd = [sys.executable, "bench/peers.py", "--size", "smoke", "--rounds", "1", "--steps", "1", "--warmup", "1",
           "--only", ONLY, "--set", f"data.path={json.dumps(str(train_data))}", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "peers.json").read_text())
    rows = result["contenders"]
    assert set(rows) == set(ONLY.split(",")), rows.keys()
    # Every framework built the same shape and trained: one parameter count, finite losses.
    assert len({r["params"] for r in rows.values()}) == 1, {n: r["params"] for n, r in rows.items()}
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows.values()), rows
    pairs = {(p["forja"], p["peer"]): p["ratio"] for p in result["pairs"]}
    assert set(pairs) == {("forja eager", "HF loop eager"), ("forja eager", "torchtitan eager")}, pairs
    assert all(math.isfinite(r) and r > 0 for r in pairs.values()), pairs
    # Equal settings: every contender under the one host setting, the HF loop on fused AdamW
    # (TrainingArguments' default), torchtitan's parallelism read from what it built.
    assert len({r["settings"]["host"] for r in rows.values()}) == 1, {n: r["settings"] for n, r in rows.items()}
    assert "fused=True" in rows["HF loop eager"]["settings"]["optimizer"]
    assert all("causal" in r["settings"]["attention"] for r in rows.values()), rows
    titan = rows["torchtitan eager"]
    assert "over a mesh of 1 rank" in titan["settings"]["parallelism_applied"], titan["settings"]
    assert titan["settings"]["torchtitan"] == "0.3.0", titan["settings"]
    assert titan["shims"], "the CPU shims torchtitan needed are listed"
    assert "| forja eager | torchtitan eager |" in (out / "peers.md").read_text()
