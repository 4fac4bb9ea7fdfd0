"""Drills: faults injected on purpose (`debug.inject`), to see a run recover.

Each drill is `KIND@STEP[:rank=R][:group=G][:repeat][:seconds=S]`:

    nan@12           the loss of step 12 becomes NaN (so do its gradients)
    spike@12         the loss of step 12 is multiplied by SPIKE_FACTOR (and its gradients)
    kill@12          the process dies by SIGKILL as step 12 begins (default rank 0)
    hang@12          the process stops answering as step 12 begins (default rank 0)
    slow@12          from step 12 on, every step sleeps `seconds` (default 0.2) first: a straggler
    bitflip@12       one bit of one weight flips as step 12 begins (default rank 0): silent data
                     corruption, for the fingerprint check (ft.check_interval) to catch
    gradflip@12      one bit of one gradient flips in step 12's first run (default rank 0), and
    actflip@12       one bit of the first block's output does: transient faults a gradient
                     carries, for the rerun of a sampled step (ft.rerun_interval) to catch
    slowsave@12      the checkpoint saved after step 12 takes `seconds` longer to write (default
                     rank 0): a save in flight, for a restart to meet
    :rank=R          only on rank R (nan and spike default to every rank)
    :group=G         only in fault-tolerant replica group G ([ft]; kill@12:group=1 is rank 0 of group 1)
    :repeat          nan/spike fire every time step 12 is trained, replays included: a bad batch.
                     Without it they fire once: a transient fault, gone on replay.

A drill that fired is written to <run.dir>/drills/rank{R}.json before it acts, so a run
restarted after `kill@12` does not die at step 12 again. Drills come only from `--set`
(forja/config.py refuses them in a file) and are never saved with the run's config. The
grammar is parsed by forja/train/config.py (`parse_drill`), where [debug] checks it at load.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from forja.files import write_atomic
from forja.train.config import Drill, parse_drill

SPIKE_FACTOR = 50.0
"""How much larger a spike drill makes the step's loss and gradients."""


class Drills:
    """This rank's drills, fired at the start of their step by `before_step`."""

    def __init__(self, specs: list[str], *, rank: int, run_dir: Path, group: int | None = None):
        self.rank = rank
        self.drills = [d for d in map(parse_drill, specs) if d.applies(rank, group)]
        self.ledger = Path(run_dir) / "drills" / f"rank{rank}.json"
        self.fired: set[str] = set(json.loads(self.ledger.read_text())) if self.ledger.is_file() else set()
        self.seconds = 0.0  # of the drill that fired last

    def before_step(self, step: int) -> str | None:
        """Act out the drills of `step`; returns the fault the step's loss gets ("nan",
        "spike") or None."""
        fault = None
        for d in self.drills:
            if d.kind == "slow" and step >= d.step:
                time.sleep(d.seconds)
            if d.step != step or d.kind == "slow" or (d.spec in self.fired and not d.repeat):
                continue
            self._mark(d)  # before acting: a killed run must not die here again once restarted
            if d.kind == "kill":
                _say(f"drill {d.spec}: rank {self.rank} kills itself (SIGKILL) at the start of step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            if d.kind == "hang":
                _say(f"drill {d.spec}: rank {self.rank} stops answering at the start of step {step}")
                hang_forever()
            fault, self.seconds = d.kind, d.seconds
        return fault

    def _mark(self, drill: Drill) -> None:
        self.fired.add(drill.spec)
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.ledger, json.dumps(sorted(self.fired)))


    def act_on_state(self, fault: str | None, parts: list, checkpoints) -> None:
        """Act out a fault of `before_step` on the run's state: `bitflip` on this rank's weights,
        `slowsave` on the checkpoint manager's next save (forja/checkpoint/manager.py)."""
        if fault == "bitflip":
            from forja.train.resilience.fingerprint import flip_one_bit

            _say(f"drill bitflip: rank {self.rank} flips {flip_one_bit(parts)}")
        if fault == "slowsave":
            checkpoints.slow_write_s = self.seconds
            _say(f"drill slowsave: rank {self.rank}'s next checkpoint takes {self.seconds:g} s longer to write")


def flipped(fault: str | None) -> str | None:
    """What a gradflip or actflip fault flips a bit of in the step's first run (StepScales.flip)."""
    return {"gradflip": "gradient", "actflip": "activation"}.get(fault)


def loss_factor(fault: str | None) -> float:
    """What a fault returned by `Drills.before_step` multiplies this rank's loss by (the step
    engine's StepScales.fault): NaN for "nan", SPIKE_FACTOR for "spike", 1 for none."""
    return {"nan": float("nan"), "spike": SPIKE_FACTOR}.get(fault, 1.0)


def hang_forever() -> None:
    """A rank stuck outside any collective, as one waiting on a dead disk or driver would be.
    Sleeping releases the GIL, so the watchdog thread can still report where it is."""
    while True:
        time.sleep(3600)


def _say(text: str) -> None:
    print(f"forja: {text}", file=sys.stderr, flush=True)
