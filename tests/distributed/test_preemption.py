"""SIGTERM to `forja train --nproc 2` (a scheduler's preemption, `kill`, scancel) reaches
the training processes through torchrun: they finish the step, save a checkpoint and
exit, and none is left behind. (torchrun starts its workers in sessions of their own, so
a launcher that died at once would orphan them, still training.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.distributed.parity import COMMON
from tests.integration.conftest import forja_process, read_metrics, train_args


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # exited while we looked
    return pids


def test_sigterm_to_the_launcher_saves_and_stops_every_process(tmp_path, train_data):
    run = tmp_path / "run"
    proc = forja_process(train_args(run, train_data, **{**COMMON, "train.steps": "1000"}) + ["--nproc", "2"])
    deadline = time.monotonic() + 180
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-5000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert "stopped by SIGTERM" in out and "checkpoint saved" in out, out[-5000:]
    step = max(r["step"] for r in read_metrics(run) if "loss" in r)
    assert (run / "checkpoints" / f"step-{step:08d}").is_dir()
    assert processes_mentioning(str(run)) == []
