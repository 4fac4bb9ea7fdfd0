"""The [ft] section: fault-tolerant replica groups coordinated by a torchft lighthouse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forja.errors import ForjaError


@dataclass(kw_only=True)
class FTConfig:
    """[ft]: the data-parallel replicas become torchft replica groups, each its own torchrun job;
    a group that dies is left behind and heals from a live peer when it comes back."""

    enabled: bool = False
    """Train as one of `groups` replica groups (`forja train --ft-groups G` sets it)."""
    groups: int = 2
    """Replica groups of the whole job. train.global_batch_size is the job's with every group live:
    each group trains global_batch_size / groups samples per step."""
    mode: Literal["hsdp", "diloco", "streaming-diloco"] = "hsdp"
    """hsdp: gradients averaged over the live groups every step. diloco: each group takes
    inner_steps steps alone, then the groups average their weight deltas and an outer Nesterov SGD
    steps. streaming-diloco: the same, one fragment of the layers at a time, its sync overlapped."""
    lighthouse: str = ""
    """The lighthouse's address (http://host:port); empty: the one `forja train --ft-groups` starts,
    or $TORCHFT_LIGHTHOUSE."""
    min_groups: int = 1
    """A step commits only when at least this many groups trained it."""
    timeout_s: float = 30.0
    """Collectives between groups and a healing transfer wait this long before the step is retried
    without the group that did not answer."""
    quorum_timeout_s: float = 120.0
    """How long a group waits for the lighthouse to form a quorum (a restarted group's first one
    waits for the others' next step)."""
    heartbeat_timeout_s: float = 3.0
    """A group silent this long is left out of the next quorum (the lighthouse's heartbeat timeout)."""
    join_timeout_s: float = 10.0
    """How long groups starting together wait for each other before training without the missing
    ones, and how long the lighthouse waits for a group it knows before a quorum forms without it."""
    inner_steps: int = 20
    """diloco: optimizer steps each group takes alone between two synchronisations."""
    outer_lr: float = 0.7
    """diloco: the outer optimizer's learning rate (Nesterov SGD on the averaged weight delta)."""
    outer_momentum: float = 0.9
    """diloco: the outer optimizer's Nesterov momentum."""
    fragments: int = 1
    """streaming-diloco: the layers are cut into this many fragments, synchronised in turn."""
    fragment_sync_delay: int = 0
    """streaming-diloco: inner steps a fragment's averaging overlaps before the group waits for it."""
    check_interval: int = 0
    """Every this many steps, replicas that should hold the same weights compare a fingerprint of
    them (silent data corruption); 0: never. Also applies without [ft], to the replicas of DDP/HSDP."""
    rerun_interval: int = 0
    """Every this many steps, the step's forward and backward run a second time on the same data and
    each rank compares the two results bit for bit (silent data corruption a gradient carries,
    forja/train/step/rerun.py); 0: never. Costs one more forward and backward per sampled step."""

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ForjaError(f"ft.groups = {self.groups}: give 1 or more replica groups")
        if not 1 <= self.min_groups <= self.groups:
            raise ForjaError(f"ft.min_groups = {self.min_groups} must be between 1 and ft.groups = {self.groups}")
        for key in ("timeout_s", "quorum_timeout_s", "heartbeat_timeout_s", "join_timeout_s"):
            if not getattr(self, key) > 0:
                raise ForjaError(f"ft.{key} = {getattr(self, key)} must be > 0 (seconds)")
        if self.inner_steps < 1:
            raise ForjaError(f"ft.inner_steps = {self.inner_steps}: give 1 or more inner steps per sync")
        if not (0 < self.outer_lr and 0 <= self.outer_momentum < 1):
            raise ForjaError(f"ft.outer_lr = {self.outer_lr} must be > 0 and ft.outer_momentum = "
                             f"{self.outer_momentum} in [0, 1)")
        if self.fragments < 1 or self.inner_steps % self.fragments:
            raise ForjaError(f"ft.fragments = {self.fragments} must be 1 or more and divide ft.inner_steps = "
                             f"{self.inner_steps} (each fragment syncs every inner_steps / fragments steps)")
        if not 0 <= self.fragment_sync_delay < self.inner_steps // self.fragments:
            raise ForjaError(f"ft.fragment_sync_delay = {self.fragment_sync_delay} must be in [0, inner_steps / "
                             f"fragments = {self.inner_steps // self.fragments}): a fragment must land before "
                             "its next sync")
        if self.mode == "diloco" and (self.fragments != 1 or self.fragment_sync_delay):
            raise ForjaError("ft.fragments and ft.fragment_sync_delay are streaming-diloco's: set "
                             "ft.mode = \"streaming-diloco\" or leave them at 1 and 0")
        for key in ("check_interval", "rerun_interval"):
            if getattr(self, key) < 0:
                raise ForjaError(f"ft.{key} = {getattr(self, key)}: give 0 (off) or a step interval")

    @property
    def shares_checkpoints(self) -> bool:
        """Whether the replica groups write one checkpoint folder (hsdp: they hold the same state;
        DiLoCo's groups each keep their own)."""
        return self.enabled and self.mode == "hsdp"

    @property
    def sync_period(self) -> int:
        """Steps from one sync to the next: a DiLoCo fragment's; 1 when every step syncs."""
        return self.inner_steps // self.fragments if self.enabled and self.mode != "hsdp" else 1

    @property
    def lighthouse_join_timeout_s(self) -> float:
        """How long the lighthouse holds a quorum for a group that is alive but not asking for one.
        Under diloco the live groups ask only at their syncs, so a restarted group must be held
        until their next one (up to quorum_timeout_s), or it would train alone on their data."""
        return self.join_timeout_s if self.mode == "hsdp" else max(self.join_timeout_s, self.quorum_timeout_s)

    def group_batch(self, global_batch_size: int) -> int:
        """Samples one group trains per step: its share of the job's global batch (all of it without [ft])."""
        return global_batch_size // self.groups if self.enabled else global_batch_size


def checkpoint_due(step: int, interval: int, period: int) -> bool:
    """Whether `step` takes the checkpoint of every `interval` steps: the first sync boundary (a
    multiple of `period`) at or after each multiple of `interval`, so that no checkpoint holds a
    sync in flight. With period 1, every multiple of `interval`."""
    return interval > 0 and step % period == 0 and step // interval > (step - period) // interval
