"""`forja train --nproc N`'s launch: torchrun's own elastic agent, run in this process, its
workers forked from a server that imported torch and forja once.

What it replaces is `python -m torch.distributed.run ... -m forja train ...` as a child
process: that cost a Python and torch start-up for torchrun, then one for every worker
(4 s of a core each), before the first step. Here the command line is still torchrun's
(`torchrun_command` spells it; torchrun's own parser reads it and its `config_from_args`
makes the launch), so every torchrun option means what torchrun says; only the workers
differ: a function, `forja train` itself, in processes forked from multiprocessing's fork
server. The server is started first (`start_server`) and imports `PRELOADED` on another
core while this process checks the config.

As torchrun's workers, each runs in a session of its own: a Ctrl-C or a SIGTERM reaches
the launcher, whose agent passes it on to them (they save a checkpoint and stop), and
only the agent stops them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import uuid
from collections.abc import Callable

# What every worker imports: torch's distributed stack and forja's trainer. Module names, not
# imports: only the fork server imports them. The server holds no device (importing touches no
# GPU), so its children start clean.
PRELOADED = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint",
             "torch.distributed.pipelining", "forja.train.trainer", "forja.train.cli"]


LAUNCHED_ENV = "FORJA_LAUNCHED"
"""Set in a worker of `forja train --nproc`: its launcher tells the user how the launch stopped."""


def start_server(processes: int) -> dict[str, str]:
    """Start the fork server for `processes` workers on this machine (it imports PRELOADED
    meanwhile); return the environment it started with, so that a worker gets what the
    launcher set since (`launch`). Each worker's thread count is set first: torch reads it when
    the server imports it (torchrun would set it later, after that import)."""
    from multiprocessing import forkserver

    from forja.host import threads_per_process

    os.environ.update(threads_per_process(processes))
    multiprocessing.set_forkserver_preload(PRELOADED)
    # A Ctrl-C in the terminal reaches the server too (it is in the terminal's process group):
    # started with SIGINT ignored, it never prints a traceback of the imports it was in. Its
    # children inherit the ignoring; each worker sets Python's handler back (enter_worker).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
    return dict(os.environ)


def launch(cmd: list[str], worker: Callable, worker_args: tuple, *, server_env: dict[str, str],
           restarts: bool = False) -> int:
    """Run torchrun's launch of `cmd` (`python -m torch.distributed.run [options] -m forja
    ...`) in this process, each worker calling `worker(*worker_args, environment_changes)`;
    return the exit code torchrun would (0; 1 when a worker failed; 128 + the signal that
    stopped the launch: the caller says what the run kept).

    With `restarts`, the workers' store is made afresh by each attempt's rank 0: the store
    the agent shares with its workers by default outlives an attempt, and the process groups
    of the next attempt would find the dead one's addresses in it under the same names."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if restarts:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = _config(torchrun, cmd)
    changed = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
    removed = [k for k in server_env if k not in os.environ]
    try:
        elastic_launch(config, entrypoint=worker)(*worker_args, (changed, removed))
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


def _config(torchrun, cmd: list[str]):
    """torchrun's launch config for `cmd`, as `python -m torch.distributed.run` makes it
    (torch/distributed/run.py: `run`), with its workers started from the fork server."""
    args = torchrun.parse_args(cmd[3:])  # after `python -m torch.distributed.run`
    if args.standalone:  # torchrun's run(): a rendezvous on a free local port, a fresh id
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "forkserver"
    for name in _STOP_NOTES_FROM:
        logging.getLogger(name).addFilter(_drop_stop_notes)
    return config


# The agent's notes on a stop it was asked for ("Received 2 death signal", one line per worker
# closed) are no news to whoever pressed Ctrl-C: the launcher says it in one line. Its other
# warnings (rendezvous, restarts) pass.
_STOP_NOTES = ("Received %s death signal", "Closing process %s via signal")
_STOP_NOTES_FROM = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


def _drop_stop_notes(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_STOP_NOTES)


def enter_worker(launcher_argv: list[str], changes: tuple[dict[str, str], list[str]]) -> None:
    """A worker's first step: a session of its own (as torchrun's workers: signals come from
    the agent only), the environment the launcher has now (the fork server's is from its
    start), the launcher's command line as its own (run.json records it), and LAUNCHED_ENV
    set: the launcher, not the worker, says why the launch stopped."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the fork server's children ignore it
    changed, removed = changes
    for key in removed:
        os.environ.pop(key, None)
    os.environ.update(changed)
    sys.argv = list(launcher_argv)
    os.environ[LAUNCHED_ENV] = "1"
