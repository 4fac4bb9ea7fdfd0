"""Helpers for tests of distributed code on one machine.

`run_distributed(fn, world_size=2)` starts `world_size` processes, each with a real
`torch.distributed` process group (Gloo on CPU), calls `fn(rank, world_size, *args)`
in each, and returns the list of their return values, ordered by rank. A process group
timeout turns a hang into a failure within seconds, and any rank's exception fails the
call with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable,
            args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
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
                    timeout_s: float = 60.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, fn, args, results))
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
