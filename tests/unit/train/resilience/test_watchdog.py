"""The hang watchdog on one rank, with real threads: it fires when no beat comes within the
timeout, reports where the training thread is stuck, and never fires when fed or stopped.
The summary's verdict is tested on synthetic reports of several ranks."""

from __future__ import annotations

import json
import threading
import time

from forja.train.resilience.watchdog import EXIT_HANG, UNRESPONSIVE, Watchdog, grace_s, read_report, summarize

TIMEOUT_S = 0.3


class ExitRecorder:
    """The exit hook of a watchdog under test: records the code, and lets the test know."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def stuck_here(exited: threading.Event) -> bool:
    """Where the 'training thread' hangs: inside the standard library (Event.wait), called
    from here, so the report's `where` must skip threading.py and name this function."""
    return exited.wait(10)


def test_a_silent_rank_writes_its_report_and_exits(tmp_path):
    recorder = ExitRecorder()
    dog = Watchdog(tmp_path, rank=0, world_size=1, timeout_s=TIMEOUT_S, exit=recorder)
    dog.start()
    try:
        dog.beat("train_step", 7)
        began = time.monotonic()
        assert stuck_here(recorder.called), "the watchdog never fired"
        waited = time.monotonic() - began
    finally:
        dog.stop()
    assert recorder.codes == [EXIT_HANG]
    assert waited >= TIMEOUT_S
    text = (tmp_path / "hang" / "rank0.txt").read_text()
    report = json.loads(text.splitlines()[0])
    assert report["rank"] == 0 and report["attempt"] == 0
    assert (report["phase"], report["step"]) == ("train_step", 7)
    assert report["collective"] is None
    assert "test_watchdog.py" in report["where"] and report["where"].endswith("in stuck_here")
    assert report["seconds_since_beat"] >= TIMEOUT_S  # rounded to the millisecond: may equal it
    assert "stuck_here" in text.split("\n", 1)[1]  # faulthandler's stacks follow the JSON line
    assert "forja-watchdog-rank0" in report["threads"].values()
    summary = (tmp_path / "hang" / "summary.txt").read_text()
    assert "rank 0: step 7, phase train_step, not in a collective: at " in summary
    assert "stuck: rank 0 (not in a collective" in summary
    assert str(tmp_path / "hang") in summary
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == ["rank0.txt", "summary.txt"]  # no temp files


def test_regular_beats_keep_it_quiet(tmp_path):
    recorder = ExitRecorder()
    dog = Watchdog(tmp_path, rank=0, world_size=1, timeout_s=2 * TIMEOUT_S, exit=recorder)
    dog.start()
    try:
        for step in range(24):  # 1.2 s in all, two timeouts; a beat every 0.05 s
            dog.beat("train_step", step)
            time.sleep(TIMEOUT_S / 6)
    finally:
        dog.stop()
    assert recorder.codes == []
    assert not (tmp_path / "hang").exists()


def test_stop_prevents_firing_and_ends_the_thread_promptly(tmp_path):
    recorder = ExitRecorder()
    dog = Watchdog(tmp_path, rank=0, world_size=1, timeout_s=TIMEOUT_S, exit=recorder)
    dog.start()
    dog.beat("train_step", 1)
    began = time.monotonic()
    dog.stop()
    assert time.monotonic() - began < 1.0
    assert not dog._thread.is_alive()
    time.sleep(3 * TIMEOUT_S)
    assert recorder.codes == []
    assert not (tmp_path / "hang").exists()


def test_it_never_fires_before_start(tmp_path):
    recorder = ExitRecorder()
    Watchdog(tmp_path, rank=0, world_size=1, timeout_s=TIMEOUT_S, exit=recorder)
    time.sleep(3 * TIMEOUT_S)
    assert recorder.codes == []


def test_start_removes_a_stale_report_of_the_same_attempt_only(tmp_path):
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "rank0.txt").write_text(json.dumps({"rank": 0, "attempt": 2}) + "\n\nstacks\n")
    (hang / "rank1.txt").write_text(json.dumps({"rank": 1, "attempt": 1}) + "\n\nstacks\n")
    (hang / "summary.txt").write_text("forja hang watchdog: ... (attempt 2, 2 ranks)\n")
    for rank in (0, 1):  # the launcher's restart 2 (DistInfo.attempt)
        dog = Watchdog(tmp_path, rank=rank, world_size=2, timeout_s=60, attempt=2, exit=ExitRecorder())
        dog.start()
        dog.stop()
    assert sorted(p.name for p in hang.iterdir()) == ["rank1.txt"]  # attempt 1's: another restart's hang
    assert read_report(hang / "rank1.txt") == {"rank": 1, "attempt": 1}


def test_the_grace_is_bounded():
    assert grace_s(1) == 5 and grace_s(100) == 25 and grace_s(3600) == 60


def report(rank: int, step: int, collective: str | None, where: str, phase: str = "train_step") -> dict:
    return dict(rank=rank, host="h", pid=100 + rank, attempt=0, step=step, phase=phase,
                seconds_since_beat=12.0, collective=collective, where=where)


def summary_of(reports: dict[int, dict], world_size: int) -> str:
    return summarize(reports, world_size, timeout_s=10, attempt=0, hang_dir="/runs/x/hang")


def test_the_summary_names_the_rank_not_in_a_collective():
    reports = {0: report(0, 5, "all_reduce", "forja/train/step/engine.py:80 in clip_gradients"),
               1: report(1, 5, None, "forja/data/loader.py:40 in _next_batch"),
               2: report(2, 5, "all_reduce", "forja/train/step/engine.py:80 in clip_gradients"),
               3: report(3, 5, "all_reduce", "forja/train/step/engine.py:80 in clip_gradients")}
    text = summary_of(reports, 4)
    assert "ranks 0, 2-3: step 5, phase train_step, waiting in all_reduce called from " \
           "forja/train/step/engine.py:80 in clip_gradients" in text
    assert "rank 1: step 5, phase train_step, not in a collective: at forja/data/loader.py:40 in _next_batch" in text
    assert "stuck: rank 1 (not in a collective" in text
    assert text.rstrip().endswith("/runs/x/hang/rank<R>.txt")
    assert "(attempt 0, 4 ranks)" in text.splitlines()[0]


def test_the_summary_names_a_silent_rank_unresponsive():
    reports = {0: report(0, 5, "all_reduce", "a.py:1 in f"), 2: report(2, 5, "all_reduce", "a.py:1 in f")}
    text = summary_of(reports, 3)
    assert f"rank 1: {UNRESPONSIVE}" in text
    assert f"stuck: rank 1, {UNRESPONSIVE}" in text


def test_a_silent_rank_is_named_beside_a_free_one():
    reports = {0: report(0, 5, "barrier", "a.py:1 in f"), 1: report(1, 5, None, "b.py:2 in g")}
    text = summary_of(reports, 3)
    assert "stuck: rank 1 (not in a collective" in text
    assert f"also rank 2: {UNRESPONSIVE}" in text


def test_when_all_wait_the_lowest_step_is_stuck():
    reports = {0: report(0, 9, "all_reduce", "a.py:1 in f"), 1: report(1, 8, "broadcast", "b.py:2 in g"),
               2: report(2, 9, "all_reduce", "a.py:1 in f")}
    assert "stuck: rank 1 (lowest step" in summary_of(reports, 3)


def test_mismatched_collectives_at_one_step_are_called_so():
    reports = {0: report(0, 9, "all_reduce", "a.py:1 in f"), 1: report(1, 9, "all_gather", "b.py:2 in g")}
    assert "no single rank is stuck: the ranks wait in different collectives" in summary_of(reports, 2)


def test_the_summary_before_the_first_step():
    text = summary_of({0: report(0, None, None, "forja/train/trainer.py:50 in run", phase="start")}, 1)
    assert "rank 0: before the first step, phase start, not in a collective" in text


def test_rank_0_waits_for_reports_of_this_attempt_only(tmp_path):
    """rank1.txt is first a stale report of another restart, then rank 1's report of this one
    arrives while rank 0 gathers: the summary must hold the new one, never the stale one."""
    hang = tmp_path / "hang"
    hang.mkdir()
    stale = dict(report(1, 2, None, "stale.py:1 in old"), attempt=7)
    (hang / "rank1.txt").write_text(json.dumps(stale) + "\n")
    fresh = report(1, 5, None, "forja/data/loader.py:40 in _next_batch")

    def rank_1_reports_late() -> None:
        deadline = time.monotonic() + 10
        while not (hang / "rank0.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        (hang / "rank1.txt").write_text(json.dumps(fresh) + "\n")

    writer = threading.Thread(target=rank_1_reports_late)
    writer.start()
    try:
        hang_once(tmp_path, step=5, world_size=2)
    finally:
        writer.join()
    summary = (hang / "summary.txt").read_text()
    assert "stale.py" not in summary
    assert "rank 1: step 5, phase train_step, not in a collective: at forja/data/loader.py:40 in _next_batch" in summary
    assert UNRESPONSIVE not in summary


def test_the_training_stack_is_reported_among_more_threads_than_faulthandler_lists(tmp_path):
    """faulthandler stops after 100 threads; a process with more (loaders, store clients) must
    still show where its training thread is stuck."""
    release = threading.Event()
    idle = [threading.Thread(target=release.wait, daemon=True) for _ in range(120)]
    for t in idle:
        t.start()
    try:
        hang_once(tmp_path, step=3)
    finally:
        release.set()
    stacks = (tmp_path / "hang" / "rank0.txt").read_text().split("\n", 1)[1].lstrip("\n")
    training = stacks.split("\n\n", 1)[0]
    assert training.startswith("Training thread") and "in stuck_here" in training


def hang_once(tmp_path, *, step: int, world_size: int = 1) -> ExitRecorder:
    """Rank 0's watchdog fires on a training thread stuck in `stuck_here` after `step`."""
    recorder = ExitRecorder()
    dog = Watchdog(tmp_path, rank=0, world_size=world_size, timeout_s=TIMEOUT_S, exit=recorder)
    dog.start()
    try:
        dog.beat("train_step", step)
        assert stuck_here(recorder.called), "the watchdog never fired"
    finally:
        dog.stop()
    return recorder
