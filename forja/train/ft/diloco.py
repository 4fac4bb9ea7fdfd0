"""DiLoCo and Streaming DiLoCo across torchft replica groups (ft.mode = "diloco" | "streaming-diloco").

Each group trains alone with the run's optimizer (the inner one). Every P = inner_steps / fragments
steps one fragment of the model is synchronised, in turn, so each fragment every inner_steps:

    delta        = theta_global - theta_local      the fragment's drift since its last sync
    delta        averaged over the live groups     (torchft's allreduce, the only traffic)
    theta_global = NesterovSGD(theta_global, delta; ft.outer_lr, ft.outer_momentum)
    theta_local  = theta_global

With ft.fragment_sync_delay = tau the average is started tau steps before it is applied: the
group trains on while it travels, and the fragment's tau local steps are then replaced by the
new global weights (Streaming DiLoCo with mixing factor 0).

A sync that does not commit (a group died while it travelled) changes nothing: theta_global stays
and the fragment keeps its local progress, which its next sync then carries.

DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105. Streaming DiLoCo: Douillard et al., arXiv:2501.18512.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forja.train.ft.config import FTConfig


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (itself for a plain tensor): the outer loop works shard by shard."""
    return t.to_local() if isinstance(t, DTensor) else t


def split_fragments(params: list[tuple[str, nn.Parameter]], fragments: int) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters in model order cut into `fragments` contiguous runs of about equal size
    (embeddings in the first, the output head in the last): each goes where its middle falls."""
    total = sum(p.numel() for _, p in params)
    cuts: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(fragments)]
    seen = 0
    for name, p in params:
        index = min(fragments - 1, (2 * seen + p.numel()) * fragments // max(2 * total, 1))
        cuts[index].append((name, p))
        seen += p.numel()
    return cuts


@dataclass
class _InFlight:
    fragment: int
    apply_at: int  # the step after which the average is applied
    deltas: list[torch.Tensor]
    works: list


class OuterLoop:
    """The global weights and outer optimizer of each fragment, and the one sync in flight.
    Stateful: the global weights and momenta are checkpointed and sent to a healing group."""

    def __init__(self, cfg: FTConfig, parts: list[nn.Module]):
        self.inner_steps, self.delay = cfg.inner_steps, cfg.fragment_sync_delay
        self.period = cfg.inner_steps // cfg.fragments
        held = {}  # each parameter once (tied weights), in model order; a pipeline rank's parts in turn
        for index, part in enumerate(parts):
            for name, p in part.named_parameters():
                held.setdefault(id(p), (f"{index}.{name}", p))
        self.fragments = split_fragments(list(held.values()), cfg.fragments)
        self.params = dict(held.values())
        with torch.no_grad():
            self.globals = {name: _local(p).detach().clone() for name, p in self.params.items()}
        self.optims = []
        for fragment in self.fragments:
            opt = torch.optim.SGD([self.globals[n] for n, _ in fragment] or [torch.zeros(1)], lr=cfg.outer_lr,
                                  momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)  # momentum 0: averaging
            for t in opt.param_groups[0]["params"]:  # zero momenta from the start: checkpointable, same update
                opt.state[t]["momentum_buffer"] = torch.zeros_like(t)
            self.optims.append(opt)
        self._names = {id(g): name for name, g in self.globals.items()}
        self.in_flight: _InFlight | None = None
        self.bytes_sent = 0  # payload handed to the allreduce, this process's shards
        self.syncs, self.failed = 0, 0

    # -- the schedule ---------------------------------------------------------------------------
    def due(self, step: int) -> int | None:
        """The fragment whose average starts after `step`, or None."""
        target = step + self.delay
        if step < 1 or target % self.period:
            return None
        return (target // self.period - 1) % len(self.fragments)

    # -- one sync -------------------------------------------------------------------------------
    def start(self, fragment: int, step: int, allreduce: Callable[[torch.Tensor], object]) -> None:
        """The fragment's drift, handed to `allreduce` (averaging in place); applied after step + delay."""
        assert self.in_flight is None, "a fragment's sync is still in flight"
        with torch.no_grad():
            deltas = [self.globals[name] - _local(p) for name, p in self.fragments[fragment]]  # shard shapes
        self.bytes_sent += sum(d.numel() * d.element_size() for d in deltas)
        self.in_flight = _InFlight(fragment, step + self.delay, deltas, [allreduce(d) for d in deltas])

    def apply_if_due(self, step: int, commit: Callable[[], bool]) -> bool | None:
        """Wait for the sync in flight when `step` is its step, then apply it if every live group
        finished it (`commit()`); None when there was nothing to apply."""
        sync = self.in_flight
        if sync is None or step != sync.apply_at:
            return None
        for work in sync.works:
            work.wait()
        self.in_flight = None
        if not commit():
            self.failed += 1
            return False
        opt = self.optims[sync.fragment]
        fragment = self.fragments[sync.fragment]
        for (name, _), delta in zip(fragment, sync.deltas, strict=True):
            self.globals[name].grad = delta
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in fragment:
                _local(p).copy_(self.globals[name])
        self.syncs += 1
        return True

    # -- Stateful ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Each fragment's global weights and outer momenta, laid out as their parameters (DTensors
        under FSDP/TP, so a checkpoint shards them as it does the model)."""
        out = {}
        for opt in self.optims:
            for t in opt.param_groups[0]["params"]:
                name = self._name_of(t)
                if name is None:
                    continue
                out[f"global.{name}"] = self._like_param(name, t)
                out[f"momentum.{name}"] = self._like_param(name, opt.state[t]["momentum_buffer"])
        return out

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for opt in self.optims:
                for t in opt.param_groups[0]["params"]:
                    name = self._name_of(t)
                    if name is None:
                        continue
                    t.copy_(_local(state[f"global.{name}"]))
                    opt.state[t]["momentum_buffer"].copy_(_local(state[f"momentum.{name}"]))
        self.in_flight = None

    def _name_of(self, t: torch.Tensor) -> str | None:
        return self._names.get(id(t))  # None: the placeholder of an empty fragment

    def _like_param(self, name: str, local: torch.Tensor) -> torch.Tensor:
        p = self.params[name]
        if isinstance(p, DTensor):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return local
