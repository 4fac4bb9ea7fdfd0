"""Starting `torch.distributed`, under torchrun or alone.

forja always runs inside a process group, even as one process, so the trainer has one
code path: under `torchrun` the group comes from its environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT); alone, a group of one is made over an in-memory store.
NCCL carries CUDA tensors and Gloo CPU ones (checkpoint metadata, loader state).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from forja.errors import ForjaError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ForjaError("train.device = 'cuda' but PyTorch sees no CUDA GPU; use train.device = 'auto' or 'cpu'")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device_choice: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the process group; returns this process's place in it."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_choice, local_rank)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ and world_size > 1:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
