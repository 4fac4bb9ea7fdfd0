"""The preflight's check of a resumed run's data stages against what it has trained on.

The loader checks every begun stage's data by fingerprint when it loads its state
(forja/data/load/stages.py); by then the model is built and the launch recorded. This check reads
only the stages record of the run's latest complete checkpoint (a few hundred bytes through
DCP) and compares each begun stage's start, path and length with the config, so that the
common mistake -- a past stage edited -- stops before anything is written or computed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from forja import storage
from forja.checkpoint import remote
from forja.checkpoint.verify import newest_intact
from forja.config import Config
from forja.data.load.stages import check_begun


def checkpoints_of(cfg: Config) -> Path | str:
    """Where the run's checkpoints live: a folder, or a URL for a run.dir in a store."""
    if storage.is_url(cfg.run.dir):
        return storage.join(cfg.run.dir, "checkpoints")
    return Path(cfg.run.dir).expanduser() / "checkpoints"


def recorded_stages(cfg: Config) -> tuple[list[dict], int] | None:
    """(the stages begun, steps done) as the latest complete checkpoint records them; None for a
    new run, or a checkpoint from before data stages."""
    # The one the resume will take: damaged newer ones (sizes, metadata; no checksums here) are
    # passed over as the resume passes over them, and named by it.
    newest = newest_intact(checkpoints_of(cfg), checksums=False).path
    if newest is None:
        return None
    state = {"dataloader": {"stages": "", "steps": 0}}
    target = remote.dcp_target(newest, write=False)
    try:
        if "dataloader.stages" not in target["storage_reader"].read_metadata().state_dict_metadata:
            return None  # saved by a forja from before data stages
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming ... a single process": each rank reads it alone, on purpose
            dcp.load(state, no_dist=True, **target)
    except (Exception, CheckpointException):  # noqa: BLE001 -- damaged after all: the resume says what is wrong
        return None
    return json.loads(state["dataloader"]["stages"]), int(state["dataloader"]["steps"])


def check_stage_history(cfg: Config) -> None:
    """Stop, naming the stage, when a stage the run has begun (after stage 0, whose data.path the
    run directory's own check guards) differs in the config in its start, path or length."""
    if cfg.run.start_over:
        return
    recorded = recorded_stages(cfg)
    if recorded is None:
        return
    past, steps = recorded
    now = [{"start_step": 1, "path": cfg.data.path, "seq_len": None}]  # stage 0: the run directory's check
    now += [{"start_step": s.start_step, "path": s.path, "seq_len": s.seq_len} for s in cfg.data.stages]
    check_begun(past, now, steps, {"start_step": None, "path": None, "seq_len": None}, first=1)
