"""A pipeline rehearsed: the schedule's start-up vote, answered as the real ranks would.

forja gives every pipeline stage the shapes it receives and sends (forja/parallel/pp.py), so
no stage runs a forward to find them. From torch 2.13 a schedule still asks its stages, on
its first step, whether they all know their shapes: a one-element int32 tensor travels down
the stages and back by point-to-point sends, and each rank reads the answer (`.item()`). A
fake tensor holds no value to read, and the fake process group delivers none, so while a
rehearsal runs, such a received vote reads as the answer every forja stage gives: 1, static.
Every other point-to-point receive (hidden states, their gradients) is torch's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily


@contextlib.contextmanager
def static_stage_votes() -> Iterator[None]:
    recv = dist.recv

    def recv_vote(tensor: torch.Tensor, *args, **kwargs):
        out = recv(tensor, *args, **kwargs)
        if isinstance(tensor, FakeTensor) and tensor.dtype == torch.int32 and tensor.numel() == 1:
            with unset_fake_temporarily():
                tensor.constant = torch.ones(1, dtype=torch.int32)  # what makes a fake tensor's .item() answer
        return out

    dist.recv = recv_vote
    try:
        yield
    finally:
        dist.recv = recv
