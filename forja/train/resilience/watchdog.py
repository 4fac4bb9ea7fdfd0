"""The hang watchdog: when no training step finishes within `parallel.timeout_s`, say who is
stuck and where, then end the job.

A hung multi-rank job is silent: every rank waits, most of them in a collective, for the one
rank that stopped (in I/O, a driver, a deadlock of its own), and the collective timeout that
eventually ends the job names only the collective. So each rank runs a `Watchdog` thread that
the training loop feeds with `beat(phase, step)`. When the last beat is older than
`timeout_s`, every rank writes `<run_dir>/hang/rank{R}.txt`: one JSON line (rank, host, pid,
attempt, step, phase, the torch.distributed collective its training thread waits in, and the
forja/user frame it was called from), then the stacks of all its threads (faulthandler).
Rank 0 gathers the reports through the file system (the process group is what is stuck, so
it cannot be used), prints one summary naming the stuck ranks and writes it to
`hang/summary.txt`; then every rank exits with `EXIT_HANG`.

The verdict: ranks that are *not* waiting in a collective are what the others wait for; if
every rank waits, the lowest step is behind; a rank with no report at all is dead or stuck
in native code holding the GIL (its Python watchdog thread cannot run).

Process-group timeouts must be `timeout_s + grace_s(timeout_s)`, so that the watchdog fires,
and rank 0 has gathered the reports, before any collective times out and ends a rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import forja
from forja.files import fsync_dir, write_atomic

EXIT_HANG = 3
"""Exit code of every rank after a hang report (1 is any error, 2 a usage/config error)."""

# The c10d calls a rank blocks in; the innermost of them is "the collective it waits on".
C10D_OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "wait_tensor", "_store_based_barrier",
})

_TORCH_DIR = os.path.dirname(torch.__file__)
_DIST_DIR = os.path.join(_TORCH_DIR, "distributed")
# torchrun's agent calls a `--nproc` worker through its own wrappers: the bottom of every stack there.
_ELASTIC_DIR = os.path.join(_DIST_DIR, "elastic")
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
# Shown paths are relative to these, in order: "forja/train/step/engine.py", "torch/distributed/...".
_ROOTS = (os.path.dirname(_TORCH_DIR), os.path.dirname(os.path.dirname(forja.__file__)))

UNRESPONSIVE = "unresponsive (no report: dead, or stuck in native code holding the GIL)"


def grace_s(timeout_s: float) -> float:
    """Seconds the watchdog needs beyond `timeout_s` to write and gather the reports; give
    every process group `timeout_s + grace_s(timeout_s)` so the watchdog always fires first."""
    return min(60.0, max(5.0, timeout_s / 4))


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder + os.sep)


def _is_library(filename: str) -> bool:
    """Torch or the standard library: frames that say how, not where, a rank waits."""
    if _under(filename, _TORCH_DIR) or filename.startswith("<frozen"):
        return True
    in_stdlib = any(_under(filename, d) for d in _STDLIB_DIRS)
    return in_stdlib and "site-packages" not in filename and "dist-packages" not in filename


def _short(filename: str) -> str:
    for root in (*_ROOTS, os.getcwd()):
        if _under(filename, root):
            return filename[len(root) + 1:]
    return filename


def _describe(frame: FrameType) -> str:
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def locate(frame: FrameType | None) -> tuple[str | None, str | None]:
    """(collective, where) of a thread whose innermost Python frame is `frame`.

    collective: the innermost c10d op (`all_reduce`...) on the stack, else the innermost
    torch.distributed function with its file; None outside torch.distributed.
    where: the innermost frame outside torch and the standard library (the forja or user code
    that made the call), else the innermost frame.
    """
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    dist_frames = [f for f in frames
                   if _under(f.f_code.co_filename, _DIST_DIR) and not _under(f.f_code.co_filename, _ELASTIC_DIR)]
    ops = [f for f in dist_frames if f.f_code.co_name in C10D_OPS]
    collective = None
    if ops:
        collective = ops[0].f_code.co_name
    elif dist_frames:
        collective = _describe(dist_frames[0])
    caller = next((f for f in frames if not _is_library(f.f_code.co_filename)), frames[0] if frames else None)
    return collective, (_describe(caller) if caller is not None else None)


def read_report(path: Path) -> dict[str, Any] | None:
    """The JSON first line of a rank's report, or None while it is absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    ranks, spans = sorted(ranks), []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _rank_line(report: dict[str, Any] | None) -> str:
    if report is None:
        return UNRESPONSIVE
    step = "before the first step" if report.get("step") is None else f"step {report['step']}"
    if report.get("collective"):
        state = f"waiting in {report['collective']} called from {report.get('where')}"
    else:
        state = f"not in a collective: at {report.get('where')}"
    return f"{step}, phase {report.get('phase')}, {state}"


def _step_key(report: dict[str, Any]) -> int:
    step = report.get("step")
    return step if isinstance(step, int) else -1


def _verdict(reports: dict[int, dict[str, Any]], missing: list[int]) -> str:
    """Which ranks the others wait for, and why we think so."""
    free = sorted(r for r, rep in reports.items() if not rep.get("collective"))
    waiting = sorted(set(reports) - set(free))
    also = f"; also {_ranks(missing)}: {UNRESPONSIVE}" if missing else ""
    if free and waiting:
        them = "it" if len(free) == 1 else "them"
        return f"stuck: {_ranks(free)} (not in a collective: the other ranks wait in one for {them}){also}"
    if missing:
        return f"stuck: {_ranks(missing)}, {UNRESPONSIVE}"
    if not reports:
        return "stuck: no rank reported"
    low = min(_step_key(rep) for rep in reports.values())
    lowest = sorted(r for r, rep in reports.items() if _step_key(rep) == low)
    if len(lowest) < len(reports):
        return f"stuck: {_ranks(lowest)} (lowest step: the other ranks went further)"
    if free:  # nobody waits in a collective, all at one step
        return (f"stuck: {_ranks(free)} (not in a collective; on GPUs a rank blocked in a CUDA sync may be "
                f"waiting for an asynchronous NCCL collective: compare where each one is)")
    kinds = {(rep.get("collective"), rep.get("where")) for rep in reports.values()}
    if len(kinds) > 1:
        return "no single rank is stuck: the ranks wait in different collectives (mismatched calls, see above)"
    return ("no single rank is stuck: every rank waits in the same collective at the same step "
            "(suspect the network or the collective backend)")


def summarize(reports: dict[int, dict[str, Any]], world_size: int, *, timeout_s: float, attempt: int,
              hang_dir: Path | str) -> str:
    """Rank 0's summary of a hang from the ranks' parsed reports (missing ranks never
    reported): a header, one line per group of ranks in the same state, the verdict, and
    where the full stacks are."""
    missing = [r for r in range(world_size) if r not in reports]
    groups: dict[str, list[int]] = {}
    for r in range(world_size):
        groups.setdefault(_rank_line(reports.get(r)), []).append(r)
    lines = [f"forja hang watchdog: no training step finished within parallel.timeout_s = {timeout_s:g} s "
             f"(attempt {attempt}, {world_size} ranks)"]
    lines += [f"  {_ranks(ranks)}: {line}" for line, ranks in sorted(groups.items(), key=lambda g: g[1][0])]
    lines.append(_verdict(reports, missing))
    lines.append(f"full stacks of every thread: {Path(hang_dir) / 'rank<R>.txt'}")
    return "\n".join(lines) + "\n"


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        print(text, file=sys.stderr, flush=True)


class Watchdog:
    """One rank's hang watchdog (see the module docstring). It watches the thread that
    called `start()` (the training loop), which must call `beat` at least every `timeout_s`.

    `exit` ends the process after a report (os._exit: the training thread is stuck, so no
    normal exit could run); tests pass a hook that records the code instead.
    """

    def __init__(self, run_dir: Path | str, *, rank: int, world_size: int, timeout_s: float, attempt: int = 0,
                 exit: Callable[[int], Any] = os._exit) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Watchdog timeout_s = {timeout_s} must be > 0")
        self.hang_dir = Path(run_dir) / "hang"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.attempt = attempt  # the launcher's restart count (DistInfo.attempt): reports of other attempts are old
        self._exit = exit
        self._interval = min(1.0, timeout_s / 10)
        self._last: tuple[str, int | None, float] = ("start", None, time.monotonic())
        self._stopped = threading.Event()
        # Orders stop() against the decision to fire; re-entrant, so a signal handler that
        # calls stop() while the training thread is inside stop() cannot deadlock.
        self._lock = threading.RLock()
        self._firing = False
        self._thread: threading.Thread | None = None
        self._watched: int | None = None

    def report_path(self, rank: int) -> Path:
        return self.hang_dir / f"rank{rank}.txt"

    def start(self) -> None:
        """Start watching the calling thread, from now."""
        if self._thread is not None:
            raise RuntimeError("Watchdog.start() was called twice")
        self._remove_stale()
        self._watched = threading.get_ident()
        self._last = ("start", None, time.monotonic())
        self._thread = threading.Thread(target=self._run, name=f"forja-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    def beat(self, phase: str, step: int | None) -> None:
        """The training loop is alive at `phase` of `step`. One tuple assignment: atomic under
        the GIL, so the thread always reads a consistent (phase, step, time)."""
        self._last = (phase, step, time.monotonic())

    def stop(self) -> None:
        """Never fire from now on. If a report is already being written (the training thread
        failed while stuck, e.g. its collective broke), wait for it: it ends the process."""
        with self._lock:
            self._stopped.set()
            firing = self._firing
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=grace_s(self.timeout_s) + 30 if firing else self._interval + 5)

    def _remove_stale(self) -> None:
        """A report of this attempt number left by an earlier job would pass for this one's;
        reports of other attempts are kept (a previous restart's hang) and ignored."""
        own = self.report_path(self.rank)
        if (read_report(own) or {}).get("attempt") == self.attempt:
            own.unlink(missing_ok=True)
        summary = self.hang_dir / "summary.txt"
        if self.rank == 0 and f"(attempt {self.attempt}," in _first_line(summary):
            summary.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            phase, step, at = self._last
            idle = time.monotonic() - at
            if idle > self.timeout_s:
                with self._lock:
                    if self._stopped.is_set():
                        return
                    self._firing = True
                self._fire(phase, step, idle)
                return

    def _fire(self, phase: str, step: int | None, idle: float) -> None:
        """Report, gather (rank 0) or wait for the summary (others), then exit, whatever fails."""
        try:
            report = self._report(phase, step, idle)
            _say(f"forja hang watchdog: rank {self.rank}: no step finished within {self.timeout_s:g} s "
                 f"(last: step {step}, phase {phase}); stacks in {self.report_path(self.rank)}")
            self._write_report(report)
            if self.rank == 0:
                summary = summarize(self._gather(report), self.world_size, timeout_s=self.timeout_s,
                                    attempt=self.attempt, hang_dir=self.hang_dir)
                write_atomic(self.hang_dir / "summary.txt", summary)
                _say(summary.rstrip("\n"))
            else:
                self._await_summary()
        except BaseException as exc:  # the thread must still end the process
            _say(f"forja hang watchdog: rank {self.rank}: the hang report failed ({exc!r}); exiting anyway")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(BaseException):
            self._exit(EXIT_HANG)

    def _report(self, phase: str, step: int | None, idle: float) -> dict[str, Any]:
        frame = sys._current_frames().get(self._watched)
        collective, where = locate(frame)
        del frame  # a frame reference keeps every local of the stuck thread alive
        threads = {f"0x{t.ident:016x}": t.name for t in threading.enumerate() if t.ident is not None}
        return dict(rank=self.rank, host=socket.gethostname(), pid=os.getpid(), attempt=self.attempt, step=step,
                    phase=phase, seconds_since_beat=round(idle, 3), collective=collective, where=where,
                    threads=threads)

    def _write_report(self, report: dict[str, Any]) -> None:
        """The JSON line, the watched (training) thread's stack, then faulthandler's stacks of
        every thread (written straight to the file descriptor), under a temporary name renamed
        when complete: rank 0 never reads half a report. The training thread comes first and
        on its own because faulthandler stops after 100 threads (data loaders, store clients and
        checkpoint writers can hold more), and it is the one stack a hang report must have."""
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        path = self.report_path(self.rank)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(report) + "\n\n")
                f.write(_watched_stack(self._watched))
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.hang_dir)

    def _gather(self, own: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Every rank's report of this attempt, waiting at most half the grace: the rest is
        margin to write the summary before any collective times out."""
        reports = {self.rank: own}
        pending = set(range(self.world_size)) - {self.rank}
        deadline = time.monotonic() + grace_s(self.timeout_s) / 2
        while pending:
            for r in sorted(pending):
                report = read_report(self.report_path(r))
                if report is not None and report.get("attempt") == self.attempt:
                    reports[r] = report
                    pending.discard(r)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self._interval)
        return reports

    def _await_summary(self) -> None:
        """Stay alive until rank 0 has written its summary (or the grace is over): a rank
        that exits closes its connections and makes torchrun stop the others, rank 0 too."""
        deadline = time.monotonic() + grace_s(self.timeout_s)
        summary = self.hang_dir / "summary.txt"
        while time.monotonic() < deadline:
            if f"(attempt {self.attempt}," in _first_line(summary):
                return
            time.sleep(self._interval)


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline()
    except OSError:
        return ""


def _watched_stack(ident: int) -> str:
    """The stack of thread `ident`, most recent call first (faulthandler's order), or "" if gone."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return ""
    lines = [f"Training thread 0x{ident:016x} (most recent call first):"]
    while frame is not None:
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
        frame = frame.f_back
    del frame
    return "\n".join(lines) + "\n\n"
