"""Replica groups as the trainer and the step engine see them: one interface, whatever the run.

    share = groups.begin_step()          # this group's part of the step (a quorum under [ft])
    ... forward, backward ...
    if groups.every_step:                # [ft] hsdp: gradients averaged over the live groups
        groups.average(grads); ok = groups.commit()
    groups.end_step(step)                # DiLoCo: a fragment's sync starts or lands

`ReplicaGroups` itself is a run without [ft]: one group, which leads, averages with nobody and
always commits, so the loop calls it unconditionally. torchft's two kinds (every-step HSDP
groups and DiLoCo) are its subclasses in forja/train/ft/replicas.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class Share:
    """This group's part of a step: share `index` of the `count` the live groups train."""

    index: int = 0
    count: int = 1


class ReplicaGroups:
    """One replica group: the run's only one (without [ft])."""

    every_step = False
    """Whether the groups average gradients and commit every step ([ft] hsdp)."""
    shares_checkpoints = False
    """Whether other groups write the same checkpoint folder (tidied by the launcher, not here)."""

    def __init__(self) -> None:
        self.share = Share()
        self.outer = None  # DiLoCo's outer loop: Stateful, checkpointed with the run

    @property
    def leads(self) -> bool:
        """Whether this group writes the step's record, validates and checkpoints."""
        return self.share.index == 0

    @property
    def purges_records(self) -> bool:
        """Whether starting the metric sinks drops records past this group's step (a resume trains
        those steps again)."""
        return True

    @property
    def saves_checkpoints(self) -> bool:
        """Whether this group writes checkpoints (its own folder, or the shared one when it leads)."""
        return self.leads or not self.every_step

    def resume_at(self, step: int) -> None:
        """The run resumed from a checkpoint of `step` (or rolled back to it)."""

    def join(self) -> None:
        """The first meeting of the groups, before the loop (a group behind the others heals here)."""

    def begin_step(self) -> Share:
        return self.share

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor averaged in place over the live groups (nothing to average with alone)."""

    def commit(self) -> bool:
        """Whether every live group finished the step."""
        return True

    def end_step(self, step: int) -> None:
        """After `step`: what the groups do between steps (DiLoCo's syncs)."""

    def finished_by_another(self, step: int, steps: int) -> int | None:
        """The step another group finished the run at, when this group (restarted late, at `step`
        of `steps`) should stand down rather than train those steps again; None: train on."""
        return None

    def fingerprint_peers(self) -> Callable[[int], list[int] | None] | None:
        """How the fingerprint check gathers each group's value ([ft] hsdp), or None: no peers."""
        return None

    def write_summary(self, folder: Path, parts: list[torch.nn.Module], step: int) -> None:
        """What this rank of the group did, for the run's record ([ft] only)."""

    def close(self) -> None:
        pass
