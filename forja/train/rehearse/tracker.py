"""What one rank allocates and sends in a rehearsed step: live bytes by category at the peak,
and every collective by kind and group.

A `TorchDispatchMode` sees each aten op of the step (below it, the fake tensor mode makes the
outputs: shapes, no data). Each new storage is recorded with its size, rounded as the CUDA
caching allocator rounds a request (512 bytes), and a category from where it was made:

    parameters          the rank's shards of the weights (and buffers), present before the step
    gathered_parameters FSDP's unsharded weights (storage grown by `resize_` when gathered)
    gradients           what `.grad` holds at the end of the step
    optimizer_state     what the optimizers' `state` holds at the end of the step
    activations         made in forward (saved for backward, or the forward's transients)
    temporaries         made in backward or the optimizer step, and not one of the above
    communication       collective inputs and outputs, FSDP's copy-in and reduce-scatter buffers

A storage's category is settled at the end (a gradient is made in backward and only then
known as one), so the peak is kept as the set of storages live at that moment and priced
afterwards. Ops on DTensors are let through (`NotImplemented`): DTensor turns them into local
ops and collectives, which come back here.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from forja.train.rehearse.collectives import CollectiveLog

CATEGORIES = ("parameters", "gathered_parameters", "gradients", "optimizer_state", "activations", "temporaries",
              "communication")
# The CUDA caching allocator hands out multiples of 512 bytes.
ROUND = 512
# FSDP2's own ops whose outputs are communication buffers (copy-in before the all-gather, the
# reduce-scatter's packed input).
_FSDP_BUFFERS = ("all_gather_copy_in", "chunk_cat")


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ROUND) * ROUND


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages of `t`, through tensor subclasses (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return storages(t.to_local())
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    return [t.untyped_storage()]


@dataclass
class Peak:
    bytes: int = 0
    phase: str = ""
    live: dict[int, int] = field(default_factory=dict)
    """Storage key -> bytes, at the moment of the peak."""


class AllocationTracker(TorchDispatchMode):
    """Live bytes of one rank, by category, and their peak over a step."""

    def __init__(self, groups: dict[str, str]):
        super().__init__()
        self.paused = False
        """While set, what is made is not the run's (DTensor's shape propagation, `untracked`)."""
        self.collectives = CollectiveLog(groups)
        self.phase = "setup"
        self.phase_of = None  # a callable naming the phase now, set while a step runs
        self.live: dict[int, int] = {}  # key -> rounded bytes
        self.label: dict[int, str] = {}  # key -> category when made (kept after it is freed)
        self.origin: dict[int, str] = {}  # key -> the op and phase that made it
        self.total = 0
        self.peak = Peak()
        self._dirty = False  # a new peak whose live set is not yet kept
        self._keys = WeakIdKeyDictionary()  # storage -> key (by identity)
        self._ids = itertools.count()
        self._resize = None

    # -- recording ----------------------------------------------------------------------------
    def add(self, tensors: Iterable[torch.Tensor], category: str, origin: str = "") -> None:
        """Record `tensors`' storages (new ones under `category`, made by `origin`)."""
        for t in tensors:
            if t.device.type == "meta" or self.paused:
                continue
            for st in storages(t):
                self._see(st, category, f"{origin} {tuple(t.shape)} {t.dtype}".replace("torch.", ""))

    def relabel(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        for t in tensors:
            for st in storages(t):
                key = self._keys.get(st)
                if key is not None:
                    self.label[key] = category

    def _see(self, st: torch.UntypedStorage, category: str, origin: str = "") -> None:
        if st in self._keys:
            return
        key = next(self._ids)
        self._keys[st] = key
        self.label[key] = category
        self.origin[key] = f"{self.phase}: {origin}"
        weakref.finalize(st, self._freed, key)
        self._grow(key, _rounded(st.nbytes()))

    def _grow(self, key: int, nbytes: int) -> None:
        old = self.live.get(key, 0)
        if nbytes < old:
            self._keep_peak()
        self.live[key] = nbytes
        self.total += nbytes - old
        if self.total > self.peak.bytes:
            self.peak.bytes, self.peak.phase, self._dirty = self.total, self.phase, True

    def _freed(self, key: int) -> None:
        if key in self.live:
            self._keep_peak()
            self.total -= self.live.pop(key)

    def _keep_peak(self) -> None:
        if self._dirty:
            self.peak.live, self._dirty = dict(self.live), False

    def restart(self) -> None:
        """Count the peak and the collectives from here (what is live stays live)."""
        self.peak = Peak(self.total, self.phase, dict(self.live))
        self._dirty = False
        self.collectives = CollectiveLog(self.collectives.groups)

    def finish(self) -> None:
        self._keep_peak()

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    # -- the mode -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it as local ops and collectives, seen here next
        out = func(*args, **(kwargs or {}))
        name = func.name()
        comm = self.collectives.record(func, args, kwargs or {}, out)
        made = self._made_now()
        category = "communication" if comm or any(b in name for b in _FSDP_BUFFERS) else made
        self.add(_tensors(out), category, name)
        if comm:  # a collective's buffers were made before it (FSDP's all-gather output, say)
            self.relabel(_tensors(args), "communication")
        if "split_with_sizes_copy" in name:  # FSDP copies the gathered weights out into them
            self.relabel(_tensors(kwargs.get("out")), "gathered_parameters")
        return out

    def _made_now(self) -> str:
        if self.phase_of is not None:
            self.phase = self.phase_of()
        return {"forward": "activations", "setup": "parameters"}.get(self.phase, "temporaries")

    def __enter__(self):
        # FSDP frees and regathers unsharded weights by resizing their storage, which no op shows.
        self._resize = torch.UntypedStorage.resize_
        tracker, original = self, self._resize

        def resize_(st, size):
            original(st, size)
            key = tracker._keys.get(st)
            if key is None:
                tracker._see(st, "gathered_parameters", "resize_")
            else:
                if size:
                    tracker.label[key] = "gathered_parameters"
                tracker._grow(key, _rounded(st.nbytes()))

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    # -- what it found ------------------------------------------------------------------------
    def at_peak(self) -> dict[str, int]:
        """Bytes live at the peak, by category."""
        out = Counter({c: 0 for c in CATEGORIES})
        for key, nbytes in self.peak.live.items():
            out[self.label[key]] += nbytes
        return dict(out)

    def largest_at_peak(self, n: int = 10) -> list[dict]:
        """The `n` largest storages live at the peak: what holds the memory, and what made it."""
        top = sorted(self.peak.live.items(), key=lambda kv: -kv[1])[:n]
        return [{"bytes": b, "category": self.label[k], "made_by": self.origin[k]} for k, b in top]
