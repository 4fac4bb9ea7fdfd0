"""`forja train RECIPE --ft-groups G --nproc N`: a lighthouse and G replica groups on this machine.

Each group is its own torchrun job of N ranks (its own rendezvous, its own `--max-restarts`:
a group that dies is restarted alone while the others train on). The lighthouse runs as a
child process too; if it dies it is started again on the same port and the groups' next
quorum finds it. On a cluster each group is a job of its own (scripts/ft_groups.sbatch):
`forja train RECIPE --ft-groups G --ft-group g --ft-lighthouse HOST:PORT --nproc N`.

The launcher of group 0 prepares the run directory once (so G groups do not race to create or
wipe it, nor to write config.toml, run.json and the tokenizer, nor to prepare the data into the
cache), tidies the checkpoint folder the groups share,
and writes <run.dir>/ft/lighthouse.json: the lighthouse's address, pid and restarts, then
ft/prepared.json, which the other launchers of the launch (other groups', other machines') wait
for before they start their groups: none writes into the directory before it is ready. Each group
writes only files of its own (ft/group<g>/: its launches, goodput, summary), and its leader the
run's metrics and checkpoints.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from forja.errors import ForjaError
from forja.files import write_atomic
from forja.host import threads_per_process
from forja.train.ft.replicas import GROUP_ENV, LIGHTHOUSE_ENV, as_url

POLL_S = 0.2


class Lighthouse:
    """The lighthouse child process, restarted on the same port when it dies."""

    def __init__(self, cfg, record: Path | None):
        self.cfg, self.record = cfg.ft, record
        self.port, self.restarts, self.address = 0, 0, ""
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        ft = self.cfg
        cmd = [sys.executable, "-m", "forja.train.ft.lighthouse", f"--port={self.port}",
               f"--min-groups={ft.min_groups}", f"--join-timeout-s={ft.lighthouse_join_timeout_s}",
               f"--heartbeat-timeout-s={ft.heartbeat_timeout_s}"]
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http"):
            raise ForjaError(f"the torchft lighthouse did not start (it said {line!r}); is port {self.port} taken?")
        self.address = line
        self.port = int(line.rsplit(":", 1)[1])
        self._write()

    def poll(self) -> None:
        """Start it again if it died (a lost lighthouse: the groups retry their quorum meanwhile)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            print(f"forja: the lighthouse (pid {self.proc.pid}) died; starting it again on port {self.port} "
                  f"(restart {self.restarts})", file=sys.stderr, flush=True)
            self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def _write(self) -> None:
        if self.record is not None:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.record, json.dumps({"address": self.address, "pid": self.proc.pid,
                                                  "restarts": self.restarts, "time": time.time()}))


def ft_overrides(args: argparse.Namespace, groups: int) -> list[str]:
    """The groups' --set overrides: the run's own, with [ft] switched on for `groups` groups."""
    return list(args.overrides) + ["ft.enabled=true", f"ft.groups={groups}"]


def launch_groups(args: argparse.Namespace, cfg, *, launcher_preflight, torchrun_command) -> int:
    """Prepare the run directory, start (or reach) the lighthouse, run the groups asked for here
    under torchrun (`torchrun_command` and `launcher_preflight` are `forja train`'s own), and wait
    for all of them; returns the worst exit code."""
    from forja.train.ft.checks import check_lighthouse
    from forja.train.launch.run_dir import RunDir

    groups = cfg.ft.groups
    here = [args.ft_group] if args.ft_group is not None else list(range(groups))
    if any(not 0 <= g < groups for g in here):
        raise ForjaError(f"--ft-group {args.ft_group} is not one of the run's {groups} groups (0 to {groups - 1})")
    worker_args = copy.copy(args)
    worker_args.overrides = [o for o in ft_overrides(args, groups) if not o.startswith("run.start_over")]
    worker_args.start_over = False  # wiped once, below: G groups must not race to wipe it again
    cmd = torchrun_command(worker_args, str(cfg.run.dir))  # its argument errors before anything starts
    launcher_preflight(cfg, nproc=args.nproc or 1, nnodes=args.nnodes)
    if args.ft_lighthouse:
        address = as_url(args.ft_lighthouse)
        check_lighthouse(address, cfg.ft.timeout_s)
    directory = RunDir(cfg)
    prepares = _prepares(here, args.nnodes)
    if prepares:  # one launcher prepares the directory, the data and the shared checkpoints
        directory.prepare(launch={"ft_groups": here})
        tidy_checkpoints(cfg, directory.checkpoints)
        prepare_data(cfg, directory.path)
    record = directory.path / "ft" / "lighthouse.json"
    lighthouse = None if args.ft_lighthouse else Lighthouse(cfg, record)
    address = lighthouse.address if lighthouse else address
    if prepares:  # the other launchers of this launch start their groups once this is written
        (directory.path / PREPARED).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(directory.path / PREPARED, json.dumps({"launch": launch_key(address), "time": time.time()}))
    else:
        wait_for_preparer(directory.path, launch_key(address), cfg.ft.quorum_timeout_s)
    env = {**os.environ, LIGHTHOUSE_ENV: address, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "RUST_LOG": os.environ.get("RUST_LOG", "warn"), **threads_per_process(len(here) * (args.nproc or 1))}
    procs = {g: subprocess.Popen(cmd, env={**env, GROUP_ENV: str(g)}) for g in here}
    print(f"forja: {len(here)} of {groups} replica groups started here, lighthouse {address}", flush=True)
    return _supervise(procs, lighthouse)


def _prepares(here: list[int], nnodes: int) -> bool:
    """Whether this launcher is the one that prepares the run directory: group 0's, and of a group
    on several machines the first machine's (SLURM_NODEID 0 in its job step, as
    scripts/ft_groups.sbatch starts them)."""
    return 0 in here and (nnodes == 1 or os.environ.get("SLURM_NODEID", "0") == "0")


PREPARED = "ft/prepared.json"
"""Written by the launcher that prepared the run directory, last: which launch it prepared."""


def launch_key(lighthouse: str) -> str:
    """What names one launch of the run to all its launchers: the SLURM job they are steps of, or
    else the lighthouse they share (its address as group 0's launcher printed it)."""
    return f"slurm job {os.environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in os.environ else as_url(lighthouse)


def wait_for_preparer(run_dir: Path, key: str, timeout_s: float) -> None:
    """A launcher that does not prepare the run directory (another group's, or a later machine of
    group 0's) waits until the one that does has done it for this launch: a group started before
    would write into a directory that is about to be wiped (--start-over) or tidied."""
    path = Path(run_dir) / PREPARED
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text()).get("launch") == key:
                return
        except (OSError, ValueError):  # not there yet, or an earlier launch's
            pass
        time.sleep(POLL_S)
    raise ForjaError(f"run.dir {run_dir} was not prepared for this launch ({key}) within ft.quorum_timeout_s = "
                     f"{timeout_s:g} s: start replica group 0's launcher (on its first machine), which prepares it "
                     "for every group, and give the others --ft-lighthouse as it printed it")


def prepare_data(cfg, run_dir: Path) -> None:
    """What a run's rank 0 does on first use of its data, done once here for every group: the
    tokenizer trained, the sources prepared into the cache, the tokenizer kept in the run
    directory. The groups' ranks then only read them (G rank 0s would each write them).
    (data.stages are refused under [ft].)"""
    from forja.train.launch.data import data, keep_tokenizer

    keep_tokenizer(data(cfg, rank=0)[0], run_dir, rank=0)


def tidy_checkpoints(cfg, folder: Path) -> None:
    """What a run's start does to its checkpoint folder, done here once for all the groups that
    share it ([ft] hsdp): partial checkpoints removed, damaged ones named and set aside. A group's
    workers then only read the folder, so a group restarted alone never deletes or moves a
    checkpoint the leading group is writing."""
    from forja.checkpoint.manager import CheckpointManager

    if cfg.ft.shares_checkpoints and cfg.checkpoint.enabled:
        manager = CheckpointManager(cfg.checkpoint, folder)
        manager.clean_partial()
        manager.resume_point()


def _supervise(procs: dict[int, subprocess.Popen], lighthouse: Lighthouse | None) -> int:
    """Wait for every group, keeping the lighthouse alive; SIGTERM is passed on to the groups
    (each saves a checkpoint and stops), Ctrl-C reaches them from the terminal directly."""
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda s, _: [p.send_signal(s) for p in procs.values()]),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    try:
        while any(p.poll() is None for p in procs.values()):
            if lighthouse is not None:
                lighthouse.poll()
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            lighthouse.stop()
    codes = {g: p.returncode for g, p in procs.items()}
    for g, code in codes.items():
        if code:
            print(f"forja: replica group {g} ended with exit code {code}", file=sys.stderr, flush=True)
    return max(codes.values(), key=abs)
