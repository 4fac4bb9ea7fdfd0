"""Helpers for tests of distributed code on one machine.

`run_distributed(fn, world_size=2)` starts `world_size` processes, each with a real
`torch.distributed` process group (Gloo on CPU), calls `fn(rank, world_size, *args)`
in each, and returns the list of their return values, ordered by rank. A process group
timeout turns a hang into a failure within seconds, and any rank's exception fails the
call with that rank's traceback. The processes are forked from a server that imported
torch and forja once (`PRELOADED`), so a call costs no import.

`stop_launchers` and `child_launchers` stop torchrun launchers a test started, workers
included, when the test fails or times out.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports anyway, imported once in the fork server: an import of torch and its
# distributed stack costs about 4 s of a core here, which used to be paid by every rank of
# every call (most of a distributed test's time: its steps take a tenth of a second).
PRELOADED = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint",
             "torch.distributed.pipelining", "forja.train.trainer"]


def _context(fresh: bool):
    """multiprocessing's fork-server context, its server importing PRELOADED (set before it
    starts: the server is made once a process, at the first call); with `fresh`, spawn's
    (a new interpreter a rank, for what must be set before an import)."""
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable,
            args: tuple, results: Any, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":  # before the group: NCCL binds each rank to the current device
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int = 2, *args: Any, backend: str = "gloo",
                    timeout_s: float = 60.0, fresh: bool = False) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results. With
    `fresh`, each rank is a new interpreter that imports what it needs after the caller's
    environment is set (e.g. TRITON_INTERPRET, read when triton is imported)."""
    ctx = _context(fresh)
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, fn, args, results,
                                                  dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s * 4)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [f"rank {r}:\n{results[r][1]}" for r in range(world_size)
                  if r in results and results[r][0] == "error"]
        if errors:
            raise RuntimeError("distributed test failed\n" + "\n".join(errors))
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise RuntimeError(f"ranks {missing} exited without a result (crashed or hung)")
        return [results[r][1] for r in range(world_size)]



def stop_launchers(pids: list[int], grace_s: float = 45.0) -> None:
    """Stop launchers (`torchrun`, `forja train --nproc`) that are children of this process,
    with their workers. torchrun starts each worker in a session of its own, so killing the
    launcher would orphan them, still running: SIGTERM lets it stop them first (it waits
    30 s for them, then kills them); SIGKILL only after `grace_s`."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    running, deadline = set(pids), time.monotonic() + grace_s
    while running and time.monotonic() < deadline:
        for pid in list(running):
            try:
                exited = os.waitpid(pid, os.WNOHANG)[0] == pid
            except ChildProcessError:  # already reaped (by its Popen)
                exited = True
            if exited:
                running.discard(pid)
        time.sleep(0.1)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def child_launchers() -> list[int]:
    """Pids of this process's children that are launchers still running (Linux /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue  # exited while we looked
        state, ppid = fields[0], int(fields[1])
        if ppid == os.getpid() and state != "Z" and (b"torch.distributed.run" in cmdline or b"-m forja" in cmdline):
            pids.append(int(stat.parent.name))
    return pids
