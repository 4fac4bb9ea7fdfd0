"""A pipeline rehearsed: the schedule's start-up vote, answered as the real ranks would.

forja gives every pipeline stage the shapes it receives and sends (forja/parallel/pp.py), so
no stage runs a forward to find them. From torch 2.13 a schedule still asks its stages, on
its first step, whether they all know their shapes: a one-element int32 tensor travels down
the stages and back by point-to-point sends, and each rank reads the answer (`.item()`). A
fake tensor holds no value to read, and the fake process group delivers none, so while a
rehearsal runs, such a received vote reads as the answer every forja stage gives: 1, static.
Every other point-to-point receive (hidden states, their gradients) is torch's own.

A stage allocates its receive buffers up front, one per micro-batch of the step (activations on
every stage but the first, their gradients on every stage but the last). A long pipeline is
rehearsed with fewer micro-batches than its step has (`fewer_pipeline_microbatches`), so
`receive_buffers_for` has its stages allocate them for the step's whole count, as the run's do.
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


@contextlib.contextmanager
def receive_buffers_for(microbatches: int) -> Iterator[None]:
    """Stages that allocate receive buffers for `microbatches` micro-batches, or for as many as
    their schedule runs if that is more; the buffers past the schedule's count are held, unused."""
    from torch.distributed.pipelining import PipelineStage

    originals = {name: getattr(PipelineStage, name) for name in ("_prepare_forward_infra", "_prepare_backward_infra")}

    def allocating_all(original):
        def prepare(self, num_microbatches: int, *args, **kwargs):
            return original(self, max(num_microbatches, microbatches), *args, **kwargs)
        return prepare

    for name, original in originals.items():
        setattr(PipelineStage, name, allocating_all(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(PipelineStage, name, original)
