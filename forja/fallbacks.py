"""The one fallback record: every requested fast path that is not taken.

A fast path that switches itself off without a word (a Triton kernel that falls back to
PyTorch, grouped GEMM that becomes a per-expert loop, float8 that converts no layer) costs
speed or memory the planner counted on, and nobody finds out. So each place that decides
not to take a requested fast path calls `record(...)` once, with what was asked, what runs
instead, why, and how to get the fast path. The trainer prints each entry as one line at
start (rank 0) and keeps them all in the launch's entry of run.json; one first recorded later
(a kernel declining on the tensors of some later step) is printed and added at the next step.

Any layer may import this module (like `forja.errors`): the decision is made in ops,
models or parallel, far from the trainer that reports it.
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Fallback:
    key: str  # a stable name of the decision, e.g. "ops.rms_norm"; one entry per key
    asked: str  # what the config asked for, naming its key
    instead: str  # what runs instead
    why: str  # the reason the fast path is not taken here
    fix: str  # how to get the fast path (or "" when nothing the user can do helps)

    def line(self) -> str:
        """The one line printed at start."""
        fix = f"; {self.fix}" if self.fix else ""
        return f"forja: fallback: {self.asked} -> {self.instead} ({self.why}){fix}"

    def as_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


_lock = threading.Lock()
_record: dict[str, Fallback] = {}
_reported: set[str] = set()
_shared: set[str] = set()  # the keys this process has handed to the report (every rank's own)


def record(key: str, *, asked: str, instead: str, why: str, fix: str = "") -> Fallback:
    """Record that the fast path `key` is not taken. Later calls with the same key keep the
    first entry: the decision is reported once, however often the code path runs."""
    with _lock:
        if key not in _record:
            _record[key] = Fallback(key=key, asked=asked, instead=instead, why=why, fix=fix)
        return _record[key]


def recorded() -> list[Fallback]:
    """Every fallback recorded in this process, in the order they were first recorded."""
    with _lock:
        return list(_record.values())


def unreported() -> list[Fallback]:
    """The entries not yet returned by this function (for printing each line once)."""
    with _lock:
        new = [f for k, f in _record.items() if k not in _reported]
        _reported.update(f.key for f in new)
        return new


def pending() -> bool:
    """Whether this process recorded a fallback since it last handed its record to the report
    (a fast path that declined after step 1: the trainer reports it at the next step)."""
    with _lock:
        return any(k not in _shared for k in _record)


def shared(keys) -> None:
    """The report has these keys of this process."""
    with _lock:
        _shared.update(keys)


def clear() -> None:
    """Forget every entry (a new run in the same process, or a test)."""
    with _lock:
        _record.clear()
        _reported.clear()
        _shared.clear()
