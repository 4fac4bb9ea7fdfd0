"""Whether a rerun has nothing to train: run.dir already reached train.steps.

Rerunning the command of a finished run (the README's quickstart, twice) must not append a
sample, a goodput launch, metrics or a run.json launch as if it had trained. So the trainer
asks first, before it starts a process group, builds a model or writes anything: the step of
the run's latest checkpoint is read from the checkpoint folder's names (forja.json marks a
complete one) and its files are checked against their checksums, all without building the model.
"""

from __future__ import annotations

import os
import sys

from forja.checkpoint.verify import complete_checkpoints, damage
from forja.config import Config, config_from_dict
from forja.errors import ForjaError
from forja.train.launch.run_dir import RunDir, config_differences

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def completed_step(cfg: Config) -> int | None:
    """The step this run stands at when it has reached train.steps; None when there is work
    (or when run.dir holds another run, or run.start_over: RunDir.prepare handles those)."""
    run = RunDir(cfg)
    if cfg.run.start_over:
        return None
    try:
        saved = run.saved_config()  # a store's run.dir: read there (an unreachable one: the preflight says so)
        if saved is None:
            return None
        old = config_from_dict(tomllib.loads(saved[1]), f"in {saved[0]}")
    except (ForjaError, OSError, ValueError):  # tomllib's decode error is a ValueError
        return None  # RunDir.prepare names the problem
    found = complete_checkpoints(run.checkpoints)
    if config_differences(old, cfg) or not found or found[-1][0] < cfg.train.steps:
        return None
    step, latest = found[-1]
    # A damaged newest checkpoint is set aside at resume and the run trained on from an older
    # one: then there is work. Its checksums are read, as a resume would (only here, when the
    # run looks complete), so that `forja export` never refuses a checkpoint this called final.
    return step if damage(latest, checksums=True) is None else None


def finished(cfg: Config) -> bool:
    """True (and one line from rank 0) when the run in run.dir is complete."""
    step = completed_step(cfg)
    if step is None:
        return False
    if int(os.environ.get("RANK", "0")) == 0:
        steps = cfg.train.steps
        at = f"of {steps}" if step == steps else f"(train.steps = {steps})"
        print(f"forja: {cfg.run.dir} is complete at step {step} {at}; give more train.steps to train further",
              flush=True)
    return True
