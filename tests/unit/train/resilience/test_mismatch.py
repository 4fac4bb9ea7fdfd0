"""What a mismatch of the replicas' fingerprints does when the run cannot go back: it stops with
one sentence naming the ranks and why (Recovery.corrupted)."""

from __future__ import annotations

import pytest

from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager
from forja.checkpoint.states import TrainerCounters
from forja.errors import ForjaError
from forja.train.config import RollbackConfig, TrainConfig
from forja.train.resilience.recovery import Recovery


class _Sink:
    def __init__(self):
        self.records = []

    def log(self, step, values):
        self.records.append((step, values))

    def log_text(self, step, name, text):
        pass


def _recovery(tmp_path, rollback_max: int) -> tuple[Recovery, _Sink]:
    sink = _Sink()
    checkpoints = CheckpointManager(CheckpointConfig(), tmp_path / "checkpoints")
    recovery = Recovery(TrainConfig(rollback=RollbackConfig(max=rollback_max)), checkpoints=checkpoints,
                        counters=TrainerCounters(), loader=None, sinks=sink, reload=lambda path: None,
                        beat=lambda phase, step: None, rolled_back=lambda: None, rank=0)
    return recovery, sink


@pytest.mark.parametrize("rollback_max, why", [(0, "train.rollback.max = 0"), (3, "no checkpoint was written yet")])
def test_a_mismatch_that_cannot_roll_back_stops_naming_the_ranks(tmp_path, rollback_max, why):
    recovery, sink = _recovery(tmp_path, rollback_max)
    message = f"step 6: silent data corruption: rank 1 differs, and {why}: training stopped"
    with pytest.raises(ForjaError, match=message):
        recovery.corrupted(6, "rank 1 differs")
    [(step, event)] = sink.records
    assert step == 6 and event["event"] == "mismatch" and event["action"] == "stop"
