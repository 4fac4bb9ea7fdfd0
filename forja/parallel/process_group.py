"""Starting `torch.distributed`, under torchrun or alone.

forja always runs inside a process group, even as one process, so the trainer has one
code path: under `torchrun` the group comes from its environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT); alone, a group of one is made over an in-memory store.
NCCL carries CUDA tensors and Gloo CPU ones (checkpoint metadata, loader state).

Every group forja uses gets the run's collective timeout (`parallel.timeout_s`), so a rank
that hangs makes the others fail within that time. torch does not do this by itself:
`dist.new_group` and `init_device_mesh` give new groups torch's own default (30 minutes
for Gloo, 10 for NCCL), whatever timeout the world group was made with; hence
`new_group` and `apply_timeout` here.
"""

from __future__ import annotations

import datetime
import os
import re
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from forja.errors import ForjaError

# parallel.timeout_s of the run in this process, set by init_distributed: process-wide,
# like torch's own process-group state, so every group made later can be given it.
_timeout = datetime.timedelta(seconds=600.0)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owned: bool = True
    """Whether this call created the process group (and so its caller destroys it); a host
    program's group (a test, a notebook training several runs) outlives each run."""
    attempt: int = 0
    """Which of its launcher's restarts this process belongs to: the launcher counts them
    (torchrun's TORCHELASTIC_RESTART_COUNT), 0 outside torchrun or in its first attempt."""


def device_type(choice: str) -> str:
    """"cuda" or "cpu": what train.device = `choice` runs on here (no device is touched)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ForjaError("train.device = 'cuda' but PyTorch sees no CUDA GPU; use train.device = 'auto' or 'cpu'")
    return "cuda"


def pick_device(choice: str, local_rank: int) -> torch.device:
    if device_type(choice) == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device_choice: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the process group; returns this process's place in it."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_choice, local_rank)
    global _timeout
    _timeout = timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():  # the host program's world group keeps the timeout it chose
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, owned=False,
                        attempt=restart_attempt())
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ and world_size > 1:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, attempt=restart_attempt())


def restart_attempt() -> int:
    """Which restart of its launcher this process belongs to (0 outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def shutdown_distributed() -> None:
    _members_only.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (a no-op alone): before reading what rank 0 wrote, say."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def new_group(ranks: list[int] | None = None, *, backend: str | None = None,
              members_only: bool = False) -> dist.ProcessGroup:
    """`dist.new_group` with the run's collective timeout rather than torch's default.
    `members_only`: only the ranks in `ranks` call it (torch's local synchronization), so a
    group of a few ranks costs the others nothing; each rank must then create such groups
    in one global order, and none may overlap another made the same way.

    torch names a members-only group after its ranks alone, so making the same one twice in
    one world group (a host program training run after run) would meet the first one's keys
    in the store and hang: such a group is made once per world group and then reused."""
    if rehearsing():  # the fake backend stands in for every backend, and takes no timeout
        backend = None
    if not members_only:
        return dist.new_group(ranks, timeout=None if rehearsing() else _timeout, backend=backend)
    key = (id(dist.group.WORLD), tuple(ranks or ()), backend)
    if key not in _members_only:
        _members_only[key] = dist.new_group(ranks, timeout=_timeout, backend=backend, use_local_synchronization=True)
    group = _members_only[key]
    set_group_timeout(group)
    return group


_members_only: dict[tuple, dist.ProcessGroup] = {}


def rehearsing() -> bool:
    """Whether the world is torch's fake process group: one process standing for every rank of
    a run, collectives that move nothing (forja's rehearsal, forja/train/rehearse.py)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def set_group_timeout(group: dist.ProcessGroup) -> None:
    """Give an existing group (one torch made: a mesh dimension, a flattened mesh) the run's
    collective timeout."""
    if rehearsing():
        return  # fake groups (a rehearsal, forja/plan/rehearse.py) wait for nothing
    if not hasattr(group, "set_timeout"):  # in torch 2.11 and 2.13; not in every older one
        warnings.warn(f"torch {torch.__version__} cannot change a process group's timeout: collectives "
                      "within sub-groups (tensor/pipeline/replica dimensions) wait torch's default "
                      "(30 min Gloo, 10 min NCCL) rather than parallel.timeout_s", stacklevel=2)
        return
    group.set_timeout(_timeout)


def apply_timeout(mesh: DeviceMesh) -> None:
    """Give every group of `mesh` the run's timeout. A dimension that spans all ranks
    reuses the world group, which already has it (or the one its host program chose)."""
    world = dist.group.WORLD
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if group is not world:
            set_group_timeout(group)


def timeout_error(exc: BaseException, timeout_s: float) -> ForjaError | None:
    """A sentence for a collective that timed out, or None if `exc` is something else.
    Backends raise a plain RuntimeError (Gloo: "Timed out waiting 5000ms for recv ..."),
    so the message is all there is to recognize it by."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or "timed out" not in text.lower():
        return None
    rank = os.environ.get("RANK", "0")
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0])  # drop gloo's "[file.cc:78]"
    return ForjaError(f"rank {rank} waited more than parallel.timeout_s = {timeout_s:g} s for the other ranks "
                      "in a collective operation: one of them has stopped (hung, crashed or killed; its log "
                      "says which). If a step can legitimately take longer (a first compile, a large "
                      f"checkpoint), raise parallel.timeout_s. [{detail}]")
