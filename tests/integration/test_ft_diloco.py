"""DiLoCo across two torchft replica groups of one Gloo rank (ft.mode = "diloco" /
"streaming-diloco", forja/train/ft/diloco.py): a run killed in every group resumes from each
group's checkpoints bit for bit, and a group lost between syncs heals at the next one and joins it."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import forja_process, losses, read_metrics, train_args

# Their drills order a kill, a heal and a quorum by sleeps of about a second: run alone (Makefile).
pytestmark = [pytest.mark.serial, pytest.mark.alone]  # groups killed on a clock

BASE = {"train.global_batch_size": "8", "train.micro_batch_size": "2", "train.seq_len": "64",
        "metrics.interval": "1", "train.val_interval": "0", "train.sample_tokens": "0",
        "parallel.timeout_s": "120", "ft.timeout_s": "10"}
STREAMING = {**BASE, "train.steps": "12", "checkpoint.interval": "4", "ft.mode": '"streaming-diloco"',
             "ft.inner_steps": "4", "ft.fragments": "2", "ft.fragment_sync_delay": "1"}


def _run(run, changes: dict, *, restarts: int = 0) -> str:
    proc = forja_process(train_args(run, _run.data, **changes)
                         + ["--ft-groups", "2", "--nproc", "1", "--max-restarts", str(restarts)])
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-5000:]
    return out


def _summaries(run) -> list[dict]:
    return [json.loads((run / "ft" / f"group{g}" / "summary-rank0.json").read_text()) for g in (0, 1)]


@pytest.fixture(autouse=True)
def _data(train_data):
    _run.data = train_data


@pytest.mark.slow
def test_streaming_diloco_killed_in_every_group_resumes_bit_for_bit(tmp_path):
    """Both groups SIGKILLed as step 7 begins (a fragment's sync in flight since step 5); each
    restarts from its own checkpoint of step 4 and the run ends as the uninterrupted one did."""
    reference = tmp_path / "uninterrupted"
    _run(reference, STREAMING)
    run = tmp_path / "killed"
    out = _run(run, {**STREAMING, "debug.inject": json.dumps(["kill@7"])}, restarts=1)
    assert out.count("kills itself (SIGKILL)") == 2, out[-5000:]
    assert (run / "checkpoints-group1").is_dir()  # each group keeps its own weights and inner optimizer
    assert losses(run) == losses(reference)  # every step, bit for bit
    # Recorded once: the groups met again at the join, so the first dropped the steps past step 4.
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == sorted(losses(reference))
    for mine, theirs in zip(_summaries(run), _summaries(reference), strict=True):
        assert mine["weights_sha256"] == theirs["weights_sha256"]
    ref = _summaries(reference)
    assert ref[0]["syncs"] == ref[1]["syncs"] == 6 and ref[0]["failed_syncs"] == 0  # one every 2 steps
    # Fragments sync apart, so the groups differ by what each trained since a fragment's last sync.
    assert ref[0]["weights_sha256"] != ref[1]["weights_sha256"]


@pytest.mark.slow
def test_a_group_lost_between_syncs_heals_at_the_next_one_and_joins_it(tmp_path):
    """diloco, 4 inner steps: group 1 dies as step 6 begins. Group 0 trains on alone; at one of
    its next syncs (after step 8, 12 or 16: when its torchrun has it back) the restarted group 1
    heals from it and takes part in that very sync, so that both groups end with the same weights."""
    run = tmp_path / "diloco"
    # Group 0 slows to 1.5 s a step once group 1 is gone, so that it is still training when
    # group 1's torchrun has it back (a restart takes seconds; the run would be over first).
    changes = {**BASE, "train.steps": "16", "checkpoint.interval": "4", "ft.mode": '"diloco"', "ft.inner_steps": "4",
               "ft.heartbeat_timeout_s": "6",
               "debug.inject": json.dumps(["kill@6:group=1", "slow@1:seconds=0.3", "slow@6:group=0:seconds=1.2"])}
    _run(run, changes, restarts=1)
    records = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 17))
    summaries = _summaries(run)
    healed = [h["step"] for h in summaries[1]["heals"]]
    assert len(healed) == 1 and healed[0] in (8, 12, 16), summaries[1]  # from group 0, not a checkpoint
    # Group 0 learns of the loss at its next quorum (after step 8): group 1's shares of steps 6-8
    # are lost with it. From then on the records say who trained.
    assert [r["ft/groups"] for r in records] == [2] * 8 + [1] * (healed[0] - 8) + [2] * (16 - healed[0])
    assert summaries[0]["weights_sha256"] == summaries[1]["weights_sha256"]
    assert summaries[0]["syncs"] == 4 and summaries[0]["failed_syncs"] == 0
    assert summaries[1]["syncs"] == (16 - healed[0]) // 4 + 1  # the sync it healed at, and those after
