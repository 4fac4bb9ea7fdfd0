"""One rank of a run, rehearsed: forja's build order and one training step on fake tensors
over torch's fake process group, in this process, at the run's full size and world size.

    with fake_world(rank, world):          # init_process_group("fake"): collectives move nothing
        mesh and groups                    # forja/parallel/dims.py, as a worker makes them
        build_model_parts(...)             # meta device -> TP -> AC -> FSDP, materialized as fake
        optimizer, schedule, step engine   # as the trainer builds them
        engine.train_step(batches)         # forward, backward, clipping, optimizer step
        the checkpoint's state dicts       # what a save stages, by the manager's own states

under an `AllocationTracker` (forja/train/rehearse/tracker.py) that prices every storage.
What a fake tensor cannot run is rehearsed on its eager path (`EAGER_NOTE`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from forja.checkpoint.states import ModelState, OptimizerState
from forja.config import Config
from forja.data.load.batch import Batch
from forja.models.common.transformer import TransformerArgs
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.parallel import ParallelDims
from forja.train.build import build_model_parts
from forja.train.rehearse.collectives import mesh_group_names
from forja.train.rehearse.kernels import device_checked_targets, flex_attention_standin, gpu_attention
from forja.train.rehearse.pipeline import receive_buffers_for, static_stage_votes
from forja.train.rehearse.routing import balanced_routing
from forja.train.rehearse.tracker import AllocationTracker
from forja.train.step.build import build_engine

EAGER_NOTE = ("rehearsed in eager mode on the CPU path: compiled graphs (async TP among them) and Triton kernels "
              "cannot run on fake tensors (FlexAttention as a stand-in holding what its kernel holds; one document "
              "per row; memory counted as the CUDA allocator rounds it)")
# Without pipeline parallelism a step's micro-batches repeat one another: the peak is reached
# by the second (the first's gradients are then held), so a step rehearses at most two.
REHEARSED_MICROBATCHES = 2


@dataclass
class RankRehearsal:
    """What one rank position held and sent."""

    rank: int
    position: str
    peak_bytes: int
    peak_phase: str
    by_category: dict[str, int]
    collectives: list[dict]
    largest: list[dict]
    """The largest storages live at the peak (bytes, category, the op that made them)."""
    checkpoint_bytes: int
    """Bytes of the rank's state dicts a checkpoint save stages (model and optimizer)."""
    microbatches: int
    microbatches_rehearsed: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return dict(self.__dict__)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size`, over torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_sharding_plans()


def _forget_sharding_plans() -> None:
    """DTensor caches each op's output placement by the meshes' shapes and names, with the mesh
    of the first call in it: the next rank position's meshes look alike but hold other groups
    (a later pipeline stage's tp group is not the first's), so each position starts afresh."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:  # torch 2.11-2.13 have it; a torch without it caches nothing to clear
        clear()


def rehearse_rank(cfg: Config, args: TransformerArgs, world_size: int, rank: int, position: str,
                  step_microbatches: int = 0) -> RankRehearsal:
    """Rehearse rank `rank` of `cfg`'s run on `world_size` ranks. `step_microbatches`: the
    step's micro-batches, where `cfg` is a long pipeline shortened to fewer of them (its stages
    still hold a receive buffer for each)."""
    began = time.perf_counter()
    with fake_world(rank, world_size), balanced_routing(), gpu_attention(), flex_attention_standin(), \
            device_checked_targets(), static_stage_votes(), receive_buffers_for(step_microbatches):
        dims = ParallelDims.from_config(cfg.parallel, world_size)
        dims.build_mesh("cpu")
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        built = build_model_parts(args, dims, cfg.parallel, device=torch.device("cpu"), seed=cfg.train.seed,
                                  load_weights=lambda part: None, seq_len=cfg.train.seq_len, float8=cfg.train.float8,
                                  float8_min_features=cfg.train.float8_min_features, materialize_in=lambda: fake)
        tracker = AllocationTracker(_group_names(dims))
        with fake, tracker, _shape_propagation_untracked(tracker):
            rehearsal = _step(cfg, args, dims, built, tracker)
    rehearsal.microbatches = max(rehearsal.microbatches, step_microbatches)
    rehearsal.rank, rehearsal.position = rank, position
    rehearsal.seconds = time.perf_counter() - began
    return rehearsal


@contextlib.contextmanager
def _shape_propagation_untracked(tracker: AllocationTracker) -> Iterator[None]:
    """DTensor finds an op's output shape by running it on whole-sized tensors of the fake mode
    it finds (on a GPU its own, holding nothing; here the rehearsal's): not the run's memory."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name, None)
    if original is None:  # another torch: DTensor's shape tensors are then counted (an overestimate)
        yield
        return

    def untracked(self, *args, **kwargs):
        with tracker.untracked():
            return original(self, *args, **kwargs)

    setattr(ShardingPropagator, name, untracked)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


def _group_names(dims: ParallelDims) -> dict[str, str]:
    names = mesh_group_names(dims.mesh)
    if dims.ep > 1:
        names = mesh_group_names(dims.groups.expert_mesh) | names
    return names


def _step(cfg: Config, args: TransformerArgs, dims: ParallelDims, built, tracker: AllocationTracker) -> RankRehearsal:
    parts = built.parts
    tracker.add([t for part in parts for t in (*part.parameters(), *part.buffers())], "parameters")
    optimizers = OptimizerGroup(parts, cfg.optim)
    scheduler = SchedulerGroup(optimizers.optimizers, cfg.schedule, cfg.train.steps)
    engine = build_engine(parts, built.pipeline, optimizers, scheduler, dims, device=torch.device("cpu"),
                          precision=cfg.train.precision, grad_clip=cfg.train.grad_clip, document_mask=False,
                          grad_sync=cfg.parallel.grad_sync)
    per_rank = cfg.train.global_batch_size // dims.dp
    micro = max(1, per_rank // cfg.train.micro_batch_size)
    rehearsed = micro if dims.pp > 1 else min(micro, REHEARSED_MICROBATCHES)
    batches = [_batch(cfg.train.micro_batch_size, cfg.train.seq_len) for _ in range(rehearsed)]
    _make_optimizer_state(optimizers, parts)
    tracker.restart()
    with _phases(tracker, optimizers):
        engine.train_step(batches)
    tracker.phase = "checkpoint"
    staged = _staged_bytes(parts, optimizers)
    tracker.finish()
    _settle(tracker, parts, optimizers)
    return RankRehearsal(rank=0, position="", peak_bytes=tracker.peak.bytes, peak_phase=tracker.peak.phase,
                         by_category=tracker.at_peak(), collectives=tracker.collectives.as_rows(),
                         largest=tracker.largest_at_peak(),
                         checkpoint_bytes=staged, microbatches=micro, microbatches_rehearsed=rehearsed, seconds=0.0)


def _batch(rows: int, seq_len: int) -> Batch:
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)  # (m, T): values do not matter to a fake tensor
    return Batch(tokens, tokens.clone(), tokens.clone())


@contextlib.contextmanager
def _phases(tracker: AllocationTracker, optimizers: OptimizerGroup) -> Iterator[None]:
    """Name the step's phase for the tracker: forward, backward (autograd's engine is running a
    graph), optimizer (an optimizer's step)."""

    def phase() -> str:
        if in_optimizer[0]:
            return "optimizer"
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    in_optimizer = [False]
    handles = []
    for opt in optimizers.optimizers:
        handles.append(opt.register_step_pre_hook(lambda *a: in_optimizer.__setitem__(0, True)))
        handles.append(opt.register_step_post_hook(lambda *a: in_optimizer.__setitem__(0, False)))
    tracker.phase_of = phase
    try:
        yield
    finally:
        tracker.phase_of = None
        for h in handles:
            h.remove()


def _make_optimizer_state(optimizers: OptimizerGroup, parts) -> None:
    """A step after the first holds the optimizer's state from the start; optimizers make it in
    their first step. So one step on zero gradients makes it, by the optimizer's own code."""
    for part in parts:
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    optimizers.step()
    optimizers.zero_grad(set_to_none=True)


def _staged_bytes(parts, optimizers: OptimizerGroup) -> int:
    """The bytes of the model's and optimizer's state dicts, the manager's own (what DCP stages)."""
    states = [ModelState(parts).state_dict(), OptimizerState(parts, optimizers.optimizers).state_dict()]
    local = [v.to_local() if hasattr(v, "to_local") else v for s in states for v in s.values()]
    return sum(t.nbytes for t in local if isinstance(t, torch.Tensor))


def _settle(tracker: AllocationTracker, parts, optimizers: OptimizerGroup) -> None:
    """Name what the step left: the gradients, the optimizer's state, the weights."""
    params = [p for part in parts for p in part.parameters()]
    tracker.relabel([p.grad for p in params if p.grad is not None], "gradients")
    state = [v for opt in optimizers.optimizers for s in opt.state.values() for v in s.values()]
    tracker.relabel([v for v in state if isinstance(v, torch.Tensor)], "optimizer_state")
    tracker.relabel(params, "parameters")
