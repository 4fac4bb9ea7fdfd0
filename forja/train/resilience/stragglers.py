"""Stragglers: the rank that makes every other rank wait.

In synchronous training every rank's step takes as long as the slowest one's, so wall step
times cannot tell ranks apart. What can is the time each rank spent *waiting for the others*
at the trainer's per-step agreement (the stop check, a collective every rank reaches after
its step): a straggler arrives last and waits least. So each rank counts

    busy = wall time since the last gather - time waited at the per-step agreement

and every `metrics.interval` steps the ranks gather (busy, data wait) per step. A rank whose
busy time is above `metrics.straggler_factor` times the median (the lower middle for an even
count) is named in the log, with its data wait, which says whether input is to blame.

`StragglerCallback` (forja/train/callbacks.py) does the counting and the naming. This sees what a rank does outside
collectives: slow data loading, a busy or throttled host,
garbage collection, I/O. A GPU slow inside its kernels holds everyone up *inside* the
collectives of the step and shows as lower MFU on every rank instead.
"""

from __future__ import annotations

import statistics


def stragglers(busy: list[float], factor: float) -> list[int]:
    """The ranks whose busy time is above `factor` times the median."""
    median = statistics.median_low(busy)
    return [r for r, b in enumerate(busy) if median > 0 and b > factor * median]
