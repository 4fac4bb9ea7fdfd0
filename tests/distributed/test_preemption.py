"""SIGTERM to `forja train --nproc 2` (a scheduler's preemption, `kill`, scancel) reaches
the training processes through torchrun's agent: they finish the step, save a checkpoint and
exit, and none is left behind. (The workers run in sessions of their own, as torchrun's, so
a launcher that died at once would orphan them, still training.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.distributed.parity import COMMON
from tests.integration.conftest import forja_process, read_metrics, train_args


def descendants(pid: int) -> set[int]:
    """The processes below `pid` now (the workers are the fork server's children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_sigterm_to_the_launcher_saves_and_stops_every_process(tmp_path, train_data):
    run = tmp_path / "run"
    proc = forja_process(train_args(run, train_data, **{**COMMON, "train.steps": "1000"}) + ["--nproc", "2"])
    deadline = time.monotonic() + 180
    while not (run / "metrics.jsonl").exists() or len(read_metrics(run)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-5000:]
        time.sleep(0.2)
    below = descendants(proc.pid)
    assert len(below) >= 2, below  # the two workers at least
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    step = max(r["step"] for r in read_metrics(run) if "loss" in r)
    assert f"stopped by SIGTERM; every process stopped, the run keeps step {step} " in out, out[-5000:]
    assert (run / "checkpoints" / f"step-{step:08d}").is_dir()
    # The fork server and multiprocessing's resource tracker leave when they read the launcher's
    # end of their pipes, a moment after it exits; a worker left training would stay.
    deadline = time.monotonic() + 10
    while [pid for pid in below if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in below if alive(pid)] == []
