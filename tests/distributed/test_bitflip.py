"""Silent data corruption (forja/train/resilience/fingerprint.py): one bit of one weight flips on
one rank (the `bitflip` drill); the replicas' fingerprints disagree at the next check, the ranks
are named, and the run goes back to its last checkpoint, whose replicas agreed. Across the two
replicas of DDP (torchrun, Gloo) and across two torchft replica groups."""

from __future__ import annotations

import json

import pytest

from forja.files import read_records
from tests.distributed.parity import COMMON
from tests.integration.conftest import forja_process, losses, read_metrics, train_args

CHECKED = {**COMMON, "train.steps": "8", "checkpoint.interval": "4", "metrics.interval": "1",
           "train.val_interval": "0", "ft.check_interval": "2", "debug.inject": json.dumps(["bitflip@5:rank=1"])}


def _train(run, data, changes: dict, *flags: str) -> str:
    proc = forja_process(train_args(run, data, **changes) + list(flags))
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-5000:]
    return out


def _mismatches(run) -> list[dict]:
    return [r for r in read_metrics(run) if r.get("event") == "mismatch"]


@pytest.mark.slow
def test_a_flipped_bit_in_one_ddp_replica_is_caught_and_rolled_back(tmp_path, train_data):
    """DDP over 2 ranks: rank 1's weight changes as step 5 begins; the check after step 6 finds the
    replicas apart, the run rolls back to step 4 and trains 5-8 again, and then every check agrees
    (the checks after steps 6 and 8, the one before the last checkpoint included). The replayed
    steps equal a clean run's bit for bit (measured once by hand: bench/RESULTS.md).

    The same run reruns every second step (ft.rerun_interval = 2): rank 1's gradient flips a bit
    in step 2's first run, its first block's output in step 4's. The weights never see those
    faults (the replicas agree at the checks after steps 2 and 4); each rerun differs, a third run
    agrees with it, and rank 1 is named: its gradients, then its forward."""
    drills = ["bitflip@5:rank=1", "gradflip@2:rank=1", "actflip@4:rank=1"]
    ddp = {**CHECKED, "parallel.dp_replicate": "2", "parallel.dp_shard": "1", "ft.rerun_interval": "2",
           "debug.inject": json.dumps(drills)}
    run = tmp_path / "flipped"
    out = _train(run, train_data, ddp, "--nproc", "2")
    assert "drill bitflip: rank 1 flips bit 10" in out, out[-3000:]
    [event] = _mismatches(run)  # caught once; after the rollback the replicas agree
    assert event["step"] == 6 and event["action"] == "rollback" and event["health/rollback_to"] == 4
    assert "rank 0 and rank 1 hold different weights" in out, out[-3000:]
    assert sorted(losses(run)) == list(range(1, 9))
    replay = [r for r in read_metrics(run) if r.get("event") == "replay"]
    assert [r["verdict"] for r in replay] == ["transient"]  # the fault did not come back on replay
    reruns = [r for r in read_metrics(run) if r.get("event") == "rerun"]
    assert [(e["step"], e["action"]) for e in reruns] == [(2, "go on"), (4, "go on")]
    texts = [r["text"] for r in read_records(run / "samples.jsonl") if r["name"] == "health"]
    assert texts[0].startswith("step 2: the gradients of rank 1 differed between the step and its rerun"), texts
    assert texts[1].startswith("step 4: the forward (its blocks' outputs) of rank 1 differed"), texts


@pytest.mark.slow
def test_a_flipped_bit_in_one_replica_group_is_caught_and_rolled_back(tmp_path, train_data):
    """Two torchft replica groups of one rank: group 1's weight changes as step 5 begins; the
    groups compare after step 6, both go back to step 4, and they end with the same weights."""
    run = tmp_path / "ft"
    changes = {**CHECKED, "ft.timeout_s": "10", "debug.inject": json.dumps(["bitflip@5:group=1"])}
    out = _train(run, train_data, changes, "--ft-groups", "2", "--nproc", "1")
    assert "drill bitflip: rank 0 flips bit 10" in out, out[-3000:]
    [event] = _mismatches(run)
    assert event["step"] == 6 and event["health/rollback_to"] == 4
    assert "of replica group(s) 0, 1 holds weights that differ" in out, out[-3000:]
    summaries = [json.loads((run / "ft" / f"group{g}" / "summary-rank0.json").read_text()) for g in (0, 1)]
    assert summaries[0]["weights_sha256"] == summaries[1]["weights_sha256"]
    assert [r["step"] for r in read_metrics(run) if "loss" in r][-1] == 8

