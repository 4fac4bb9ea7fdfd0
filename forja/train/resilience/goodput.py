"""Goodput: the share of a run's wall time spent in steps that made it into the final model.

    goodput = productive seconds / wall seconds

Productive seconds are the step times the trainer counts in its checkpointed counters, so a
step lost to a crash or undone by a rollback drops out with the state that held it, and a
skipped step never counts. Wall seconds span every launch of the run (its segments,
recorded by rank 0 in <run.dir>/goodput.json): setup, compilation, validation, checkpoint
stalls, replays, and, after a launch that died, the time until the next one began (a
restart). The gap after a launch that ended cleanly is not counted: training the run
further next week does not make this week's goodput worse.

Each launch's start-up (process group, data, model build, resume: up to the first step) is
recorded apart, so that the end-of-run line can show it beside the steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from forja.files import write_atomic

FILE = "goodput.json"


class Goodput:
    """Rank 0's ledger of the run's launches ("segments")."""

    def __init__(self, run_dir: Path, *, rank: int):
        self.path = Path(run_dir) / FILE
        self.rank = rank
        self.segments: list[dict] = []
        if self.path.is_file():
            self.segments = json.loads(self.path.read_text()).get("segments", [])

    def start(self, at: float | None = None) -> None:
        """A launch began at `at` (time.time(); default now): setup time counts as lost."""
        now = time.time()
        self.segments.append({"start": at or now, "last": now, "clean": False, "checkpoint_s": 0.0, "rollbacks": 0})
        self._write()

    def ready(self) -> None:
        """The launch's setup is over (the first step is next): its start-up is recorded apart."""
        if self.segments:
            self.segments[-1]["startup_s"] = time.time() - self.segments[-1]["start"]
            self._write()

    def beat(self, *, checkpoint_s: float = 0.0, rollback: bool = False) -> None:
        """The launch is alive at this moment (called at each checkpoint, rollback and the end),
        with seconds the loop stood still for a checkpoint, or a rollback that happened. A launch
        that dies after its last beat counts the rest as the wait before the next launch."""
        if not self.segments:
            return
        seg = self.segments[-1]
        seg["last"] = time.time()
        seg["checkpoint_s"] += checkpoint_s
        seg["rollbacks"] += int(rollback)
        self._write()

    def end(self) -> None:
        """The launch ended by itself (done, or stopped and saved): the pause after it is no loss."""
        if self.segments:
            self.segments[-1]["clean"] = True
            self.beat()

    def wall_s(self) -> float:
        """Seconds of the run so far: each segment, plus the wait after each one that died."""
        total = 0.0
        for i, seg in enumerate(self.segments):
            end = time.time() if i == len(self.segments) - 1 else seg["last"]
            total += end - seg["start"]
            if i + 1 < len(self.segments) and not seg["clean"]:
                total += self.segments[i + 1]["start"] - seg["last"]
        return total

    def summary(self, productive_s: float) -> dict[str, float]:
        """The figures logged at the end of a run and shown by `forja report`."""
        wall = self.wall_s()
        restarts = sum(1 for seg in self.segments[:-1] if not seg["clean"])
        return {"goodput": productive_s / wall if wall > 0 else 0.0, "productive_s": productive_s, "wall_s": wall,
                "restarts": restarts, "rollbacks": sum(s["rollbacks"] for s in self.segments),
                "checkpoint_stall_s": sum(s["checkpoint_s"] for s in self.segments),
                "startup_s": sum(s.get("startup_s", 0.0) for s in self.segments)}

    def _write(self) -> None:
        if self.rank == 0:
            write_atomic(self.path, json.dumps({"segments": self.segments}, indent=1))


def goodput_line(figures: dict[str, float]) -> str:
    """The end-of-run line: what goodput counts, and where the rest of the wall time went, with
    start-up apart (paid once per launch, it is most of a short run's loss)."""
    wall, steps, startup = figures["wall_s"], figures["productive_s"], figures.get("startup_s", 0.0)
    stalls = figures["checkpoint_stall_s"]
    other = max(0.0, wall - steps - startup - stalls)
    line = (f"forja: goodput {figures['goodput']:.1%} ({steps:.1f} s of {wall:.1f} s in steps that count; start-up "
            f"{startup:.1f} s, checkpoint stalls {stalls:.1f} s, other {other:.1f} s; {figures['restarts']} restarts, "
            f"{figures['rollbacks']} rollbacks)")
    if wall > 0 and startup / wall >= SHORT_RUN_STARTUP:
        line += "\n  (start-up is paid once per launch: a run of a few seconds of steps reads low, as expected)"
    return line


SHORT_RUN_STARTUP = 0.2
"""Start-up's share of the wall time from which the line says a low goodput is a short run's."""
