"""The hang watchdog across two real Gloo ranks: rank 1 stops in Python while rank 0 waits
for it in an all_reduce. Both must report, rank 0 must name rank 1 as the stuck one, and
both must exit with EXIT_HANG long before the process group's own timeout.

The ranks are started here rather than by forja.testing.run_distributed, which expects
each rank to return a result: these end through the watchdog's os._exit."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forja.testing import free_port
from forja.train.resilience.watchdog import EXIT_HANG, Watchdog, grace_s

WATCHDOG_S = 1.0
PG_TIMEOUT_S = 20.0  # far beyond the watchdog: the collective must not be what ends the ranks


def sleep_forever() -> None:
    time.sleep(60)  # rank 1's hang: alive, in Python, outside any collective


def _rank(rank: int, world_size: int, port: int, run_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    dist.all_reduce(torch.ones(1))  # both ranks connected: what follows is a hang, not a slow start
    dog = Watchdog(run_dir, rank=rank, world_size=world_size, timeout_s=WATCHDOG_S)
    dog.start()
    try:  # as the trainer does: stop() on every way out
        dog.beat("train_step", 3)
        if rank == 1:
            sleep_forever()
        else:
            dist.all_reduce(torch.ones(1))
    finally:
        dog.stop()
    os._exit(0)  # only reached if the watchdog did not end the process


def test_rank_0_names_the_rank_the_others_wait_for(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    began = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(PG_TIMEOUT_S + 30)
    took = time.monotonic() - began
    for p in procs:
        if p.is_alive():
            p.kill()
    hang = Path(tmp_path) / "hang"
    listing = sorted(p.name for p in hang.iterdir()) if hang.exists() else []
    assert [p.exitcode for p in procs] == [EXIT_HANG, EXIT_HANG], listing
    assert took < PG_TIMEOUT_S, f"{took:.1f} s: the collective timeout, not the watchdog, ended the ranks"
    assert listing == ["rank0.txt", "rank1.txt", "summary.txt"]
    reports = [json.loads((hang / f"rank{r}.txt").read_text().splitlines()[0]) for r in range(2)]
    assert reports[0]["collective"] == "all_reduce"
    assert reports[0]["where"].startswith("tests/distributed/test_watchdog.py:")
    assert reports[0]["where"].endswith(" in _rank")
    assert reports[1]["collective"] is None
    assert reports[1]["where"].endswith(" in sleep_forever")
    assert [(r["step"], r["phase"], r["pid"]) for r in reports] == [(3, "train_step", p.pid) for p in procs]
    summary = (hang / "summary.txt").read_text()
    assert "rank 0: step 3, phase train_step, waiting in all_reduce called from tests/distributed/" in summary
    assert "rank 1: step 3, phase train_step, not in a collective: at tests/distributed/" in summary
    assert "stuck: rank 1 (not in a collective" in summary
    print(f"both ranks exited {took:.1f} s after start (watchdog {WATCHDOG_S} s, grace {grace_s(WATCHDOG_S)} s)")
