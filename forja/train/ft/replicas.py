"""One replica group's side of a fault-tolerant run (torchft).

A fault-tolerant run is G replica groups, each its own torchrun job of N ranks laid out as
any run is (FSDP, TP... inside the group); the groups are coordinated by a torchft lighthouse
and talk over torchft's reconfigurable process group. Every step of ft.mode = "hsdp":

    begin_step()  the quorum: which groups are live (Share: this group's place among them).
                  A group behind the others (just restarted) receives the current weights,
                  optimizer, schedule, data cursor and counters from a live peer here.
    average(...)  the gradients (and the loss) averaged over the live groups
    commit()      whether every live group finished the step; if not, nobody steps and the
                  step is trained again with the groups that are left

The data follows the groups: each step a group trains `global_batch_size / groups` samples
(a share), the live groups take consecutive shares, and the cursor moves by as many shares as
groups trained, so no sample is skipped or trained twice whatever fails.

ft.mode = "diloco" / "streaming-diloco" (forja/train/ft/diloco.py) talks far less: no quorum
and no average in the step. end_step() starts a fragment's sync on its schedule, with a quorum
first (so a restarted group heals there, and joins that very sync), and applies it when due.
Between two quorums the share stays that of the last one.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forja.checkpoint.verify import complete_checkpoints
from forja.errors import ForjaError
from forja.files import write_atomic
from forja.train.ft.config import FTConfig
from forja.train.step.groups import ReplicaGroups, Share

GROUP_ENV = "FORJA_FT_GROUP"
"""The replica group this process belongs to (set by the launcher or the SLURM template)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
QUORUM_RETRIES = 20


def group_of(cfg) -> int | None:
    """This process's replica group under [ft], from $FORJA_FT_GROUP; None without [ft]."""
    if not cfg.ft.enabled:
        return None
    raw = os.environ.get(GROUP_ENV)
    if raw is None or not raw.isdigit():
        raise ForjaError(f"ft.enabled is set but ${GROUP_ENV} is {raw!r}: start the groups with "
                         "`forja train RECIPE --ft-groups G --nproc N`, or give each group's job its number "
                         f"({GROUP_ENV}=0, 1, ...) as scripts/ft_groups.sbatch does")
    return int(raw)


def lighthouse_address(cfg: FTConfig) -> str:
    address = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ForjaError("ft.enabled is set but no lighthouse is named: set ft.lighthouse = \"http://HOST:PORT\", "
                         f"${LIGHTHOUSE_ENV}, or let `forja train --ft-groups G` start one")
    return as_url(address)


def as_url(address: str) -> str:
    """HOST:PORT as the http:// URL torchft's clients take (a URL stays as it is)."""
    return address if "://" in address else f"http://{address}"


class TorchftGroups(ReplicaGroups):
    """This process's torchft manager and what the step engine asks of it. `state()` returns
    the run's Stateful pieces by name (a healing peer's are loaded into them); `identity` is what
    every group must share (model, layout, batch), checked when a group joins. Its two kinds:
    HsdpGroups and DilocoGroups, below."""

    def __init__(self, cfg: FTConfig, *, group: int, state: Callable[[], dict[str, Any]], identity: dict[str, Any],
                 device: torch.device, attempt: int = 0):
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        super().__init__()
        self.cfg, self.group, self.state, self.identity = cfg, group, state, identity
        self.attempt = attempt  # which restart of its torchrun this group is (DistInfo.attempt)
        self._device = device
        self._preparing: int | None = None  # the fragment whose sync this quorum starts (sent to a healer)
        self._join_sync: tuple[int, int] | None = None  # (fragment, step) of the peers' sync a heal joined
        self.steps_trained, self.uncommitted = 0, 0
        self.heals: list[dict[str, float]] = []  # the step each heal brought this group to, and when
        timeout = timedelta(seconds=cfg.timeout_s)
        self.pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        host, port = _group_store()
        self.manager = Manager(
            pg=self.pg, min_replica_size=cfg.min_groups, load_state_dict=self._load, state_dict=self._save,
            use_async_quorum=False,  # the share of the data must be known before the step's forward
            init_sync=True,  # groups meeting at step 0 take the first's state too: its identity is checked then
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.timeout_s),
            rank=dist.get_rank(), world_size=dist.get_world_size(), store_addr=host, store_port=port,
            lighthouse_addr=lighthouse_address(cfg), replica_id=f"forja_group_{group}",
            hostname=socket.gethostname(), heartbeat_interval=timedelta(milliseconds=100),
            quorum_retries=QUORUM_RETRIES)  # a lost lighthouse: asked again while it is restarted
        self._joined = False

    # -- the step ---------------------------------------------------------------------------
    def resume_at(self, step: int) -> None:
        """The run resumed from a checkpoint of `step`: the quorum compares steps to find who heals.
        Under diloco the quorum's step is 2 * step at a sync's start and 2 * step + 1 once a step is
        over, so a group resumed at `step` is behind the live ones at any later sync."""
        self._set_quorum_step(step if self.every_step else 2 * step + 1)

    def _set_quorum_step(self, step: int) -> None:
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.cfg.groups})

    def join(self) -> None:
        """The first quorum, before the loop. A group behind the live ones heals here (so the
        metric sinks start at the step it rejoins; its identity is checked as it loads). Groups
        starting together wait up to ft.join_timeout_s for each other, so that none trains the
        first steps alone."""
        deadline = time.monotonic() + self.cfg.join_timeout_s
        self._quorum()
        # (Not once healed at a diloco sync: the live groups are waiting in it for this one.)
        while self.share.count < self.cfg.groups and self._join_sync is None and time.monotonic() < deadline:
            time.sleep(0.2)
            self._quorum()
        self._joined = True
        if self._join_sync is not None:  # healed at the live groups' sync: take part in it
            fragment, step = self._join_sync
            self._join_sync = None
            self.outer.start(fragment, step, self.manager.allreduce)
            self._apply(step)

    def begin_step(self) -> Share:
        """The quorum of the next step (the join's, for the first one)."""
        if not self._joined and self.every_step:
            self._quorum()
        self._joined = False
        return self.share

    def _quorum(self) -> None:
        self.manager.start_quorum()  # synchronous: applies a healing peer's state before returning
        rank = self.manager.participating_rank()
        self.share = Share(index=rank or 0, count=max(1, self.manager.num_participants()))

    @property
    def leads(self) -> bool:
        """Whether this group writes the step's record, validates and checkpoints: the first live one."""
        return self.share.index == 0

    @property
    def purges_records(self) -> bool:
        """Whether starting the metric sinks drops what was recorded past this group's step (a
        resumed run trains those steps again). The groups share the records, so only the join's
        first group does, when every group met there (none can have recorded further) or at a
        fresh launch. A group restarted alone that met only some leaves them: the absent ones
        may be live and recording."""
        return self.leads and (self.share.count == self.cfg.groups or self.attempt == 0)

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor (a gradient's local shard, the loss) averaged in place over the live groups.
        A group that died mid-step leaves these unfinished: commit() then says no."""
        works = [self.manager.allreduce(t) for t in tensors]
        for work in works:
            work.wait()

    def gather(self, value: int) -> list[int] | None:
        """Each live group's `value` (an unsigned 64-bit fingerprint), in share order; None when the
        exchange failed. torchft averages, so each group puts its value, cut into 16-bit pieces that
        a float64 holds exactly however many groups add up, in its own slots."""
        n = self.share.count
        slots = torch.zeros(n * 4, dtype=torch.float64, device=self._device)
        for k in range(4):
            slots[self.share.index * 4 + k] = float((value % (1 << 64)) >> (16 * k) & 0xFFFF)
        self.manager.allreduce(slots).wait()
        if self.manager.errored() is not None:
            return None
        pieces = (slots.cpu() * n).round().to(torch.int64).tolist()
        return [sum(int(pieces[g * 4 + k]) << (16 * k) for k in range(4)) for g in range(n)]

    def commit(self) -> bool:
        """Whether every live group finished the step (the optimizer may step)."""
        committed = self.manager.should_commit()
        self.steps_trained += int(committed)
        self.uncommitted += int(not committed)
        return committed

    def write_summary(self, folder: Path, parts: list[torch.nn.Module], step: int) -> None:
        """<folder>/summary-rank{R}.json: what this rank of the group did (steps it trained, heals,
        uncommitted steps) and a digest of the weights it ends with, equal in every group."""
        digest = hashlib.sha256()
        for part in parts:
            for name, p in sorted(part.named_parameters()):
                local = p.detach().to_local() if isinstance(p, DTensor) else p.detach()
                digest.update(name.encode())
                digest.update(local.float().cpu().contiguous().numpy().tobytes())
        summary = {"group": self.group, "step": step, "steps_trained": self.steps_trained,
                   "uncommitted": self.uncommitted, "heals": self.heals, "weights_sha256": digest.hexdigest()}
        if self.outer is not None:  # diloco: the syncs, and the bytes this rank handed to them
            summary |= {"syncs": self.outer.syncs, "failed_syncs": self.outer.failed,
                        "sync_bytes": self.outer.bytes_sent}
        write_atomic(Path(folder) / f"summary-rank{dist.get_rank()}.json", json.dumps(summary, indent=1))

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # -- healing: what a live peer sends and a joiner loads -----------------------------------
    def _save(self) -> dict[str, Any]:
        return {"identity": self.identity, "preparing": self._preparing,
                "state": {name: _to_local(obj.state_dict()) for name, obj in _stepped(self.state()).items()}}

    def _load(self, received: dict[str, Any]) -> None:
        _check_same(self.identity, received["identity"], self.group)
        if received.get("preparing") is not None:  # diloco: the peer is starting a sync: join it
            self._join_sync = (int(received["preparing"]), int(received["state"]["trainer"]["step"]))
        for name, obj in self.state().items():
            if name in received["state"]:  # an optimizer that has not stepped yet is not sent
                obj.load_state_dict(_from_local(received["state"][name], obj.state_dict()))
        step = int(received["state"]["trainer"]["step"])
        self.heals.append({"step": step, "time": time.time()})


class HsdpGroups(TorchftGroups):
    """ft.mode = "hsdp": the live groups average gradients and commit every step, hold the same
    state, and share one checkpoint folder (written by the leading group)."""

    every_step = True
    shares_checkpoints = True

    def __init__(self, cfg: FTConfig, *, checkpoints: Path | str, cpu_group, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self.checkpoints, self.cpu_group = checkpoints, cpu_group  # the shared folder; the group's ranks

    def finished_by_another(self, step: int, steps: int) -> int | None:
        """Resumed from the leader's last checkpoint, or training alone (restarted while the others
        ran on) when the leader's last save lands in the shared folder. The group's ranks agree."""
        if step >= steps:
            return step
        if self.share.count >= self.cfg.groups:
            return None
        found = complete_checkpoints(self.checkpoints)
        newest = torch.tensor([found[-1][0] if found else 0], dtype=torch.int64)
        if dist.get_world_size() > 1:
            dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(newest.item()) if newest.item() >= steps else None

    def fingerprint_peers(self):
        return self.gather


class DilocoGroups(TorchftGroups):
    """ft.mode = "diloco" / "streaming-diloco": each group trains alone and syncs a fragment of
    the model every inner_steps / fragments steps (forja/train/ft/diloco.py); each keeps its own
    weights, inner optimizer and checkpoints."""

    every_step = False

    def __init__(self, cfg: FTConfig, *, parts: list[torch.nn.Module], **kwargs: Any):
        from forja.train.ft.diloco import OuterLoop

        super().__init__(cfg, **kwargs)
        self.outer = OuterLoop(cfg, parts)

    def end_step(self, step: int) -> None:
        """After `step`, start the sync of the fragment due (a quorum first), and apply the sync
        in flight when its step has come."""
        self.steps_trained += 1
        fragment = self.outer.due(step)
        if fragment is not None:
            self._set_quorum_step(2 * step)
            self._preparing = fragment
            try:
                self._quorum()
            finally:
                self._preparing = None
            self.outer.start(fragment, step, self.manager.allreduce)
        self._apply(step)

    def _apply(self, step: int) -> None:
        applied = self.outer.apply_if_due(step, self.manager.should_commit)
        if applied is False:
            self.uncommitted += 1  # under diloco: a sync that did not commit


def _stepped(state: dict[str, Any]) -> dict[str, Any]:
    """`state` less an optimizer that holds no state yet (step 0): asking torch for its state dict
    would initialize it with a step of lr 0, and Adam's bias correction would count that step."""
    optim = state.get("optim")
    if optim is not None and not any(opt.state for opt in getattr(optim, "optimizers", [])):
        state = {k: v for k, v in state.items() if k != "optim"}
    return state


def _group_store() -> tuple[str, int]:
    """A TCPStore for this group's manager, hosted by the group's rank 0 (torchrun's own store is
    not shared with its workers when they may restart); its port is sent to the group's ranks."""
    host = socket.gethostname()
    store = None
    if dist.get_rank() == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _keep.append(store)
    port = [store.port if store is not None else 0]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(port, src=0)
    return host, int(port[0])


_keep: list[Any] = []  # the group store lives as long as the process


def _check_same(mine: dict[str, Any], theirs: dict[str, Any], group: int) -> None:
    differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if differ:
        said = "; ".join(f"{k}: this group {mine.get(k)!r}, the live groups {theirs.get(k)!r}" for k in differ)
        raise ForjaError(f"ft group {group} cannot join: {said}. Every replica group must run the same model, "
                         "layout and batch: start it with the run's config")


def _to_local(tree: Any) -> Any:
    """A state dict with each DTensor as its local shard (a peer's shards match ours: same layout)."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().cpu()
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_local(v) for v in tree)
    return tree


def _from_local(tree: Any, template: Any) -> Any:
    """`tree` from `_to_local` with tensors laid out as `template`'s (this rank's own state dict)."""
    if isinstance(template, DTensor):
        local = tree.to(template.device, template.dtype)
        return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    if isinstance(template, torch.Tensor):
        return tree.to(template.device, template.dtype) if isinstance(tree, torch.Tensor) else tree
    if isinstance(template, dict) and isinstance(tree, dict):
        return {k: _from_local(v, template.get(k)) for k, v in tree.items()}
    if isinstance(template, (list, tuple)) and isinstance(tree, (list, tuple)) and len(tree) == len(template):
        return type(tree)(_from_local(v, t) for v, t in zip(tree, template, strict=True))
    return tree


def build_replicas(cfg, *, group: int | None, state: Callable[[], dict[str, Any]], model: dict[str, Any],
                   parts: list[torch.nn.Module], device: torch.device, checkpoints: Path | str,
                   cpu_group=None, attempt: int = 0) -> ReplicaGroups:
    """The run's replica groups as replica group `group` sees them (the single group without
    [ft]): `model` is the checkpoint identity of the model, and with it every group must share
    its layout and batch. Under diloco the outer loop runs over `parts` (this rank's model parts);
    under hsdp the groups share the folder `checkpoints` (`cpu_group`: this group's ranks);
    `attempt`: which restart of its launcher this group is (DistInfo.attempt)."""
    if group is None:
        return ReplicaGroups()
    p, t, ft = cfg.parallel, cfg.train, cfg.ft
    identity = {"model": model, "train.global_batch_size": t.global_batch_size, "train.seq_len": t.seq_len,
                "train.micro_batch_size": t.micro_batch_size, "ft.groups": ft.groups, "ft.mode": ft.mode,
                "ranks per group": dist.get_world_size(),
                **{f"parallel.{k}": getattr(p, k) for k in ("dp_shard", "tp", "pp", "cp", "ep")}}
    if ft.mode == "hsdp":
        return HsdpGroups(ft, checkpoints=checkpoints, cpu_group=cpu_group, group=group, state=state,
                          identity=identity, device=device, attempt=attempt)
    identity |= {f"ft.{k}": getattr(ft, k) for k in ("inner_steps", "fragments", "fragment_sync_delay",
                                                      "outer_lr", "outer_momentum")}
    return DilocoGroups(ft, parts=parts, group=group, state=state, identity=identity, device=device,
                        attempt=attempt)


def group_dir(run_dir: Path, group: int | None) -> Path:
    """Where this process keeps files its rank writes (goodput, drills, hang reports, the summary):
    the run directory, or under [ft] the group's own folder in it, as G groups have G rank 0s."""
    if group is None:
        return run_dir
    path = run_dir / "ft" / f"group{group}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoint_dir(base: Path | str, cfg, group: int | None) -> Path | str:
    """This group's checkpoint folder: the run's, except under diloco for groups after the first,
    which keep their own weights and inner optimizer beside it (`checkpoints-group<g>`)."""
    if group is None or group == 0 or cfg.ft.mode == "hsdp":
        return base
    return base.with_name(f"{base.name}-group{group}") if isinstance(base, Path) else f"{base}-group{group}"


class LeaderOnly:
    """A group's metric sinks as its recovery sees them: under [ft] only the first live group
    writes records (an anomaly every group meets is recorded once)."""

    def __init__(self, sinks, leads: Callable[[], bool]):
        self.sinks, self.leads = sinks, leads

    def log(self, step: int, values: dict) -> None:
        if self.leads():
            self.sinks.log(step, values)

    def log_text(self, step: int, name: str, text: str) -> None:
        if self.leads():
            self.sinks.log_text(step, name, text)
