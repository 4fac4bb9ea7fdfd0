"""Measuring helpers shared by the benchmark scripts (run them from a checkout)."""

from __future__ import annotations


def allocator_peak(prof) -> int:
    """The highest point of the running sum of torch's allocations and frees that a
    `torch.profiler.profile(profile_memory=True)` recorded, in bytes.

    Reads `prof.profiler.kineto_results`, which is semi-private: only benchmarks rely on it."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in records:
        running += nbytes
        peak = max(peak, running)
    return peak
