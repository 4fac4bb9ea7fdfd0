"""A layout: how one job is spread over the ranks, as the planner sees it.

A `Layout` holds exactly the values `forja train` reads from `parallel.*` and
`train.micro_batch_size` (its degrees as one `Degrees` value, forja/parallel/degrees.py), so
a plan's choice is a list of `--set` overrides (`overrides`) and any run's config gives back
its layout (`Layout.from_config`). `parse_fixed` reads `forja plan --layout` as `--set` reads
its values; `enumerate_layouts` lists the layouts that divide a world size, for the search.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from forja.config import coerce_key, parse_value
from forja.errors import ForjaError
from forja.parallel.config import CP_KINDS, ParallelConfig
from forja.parallel.degrees import AXIS_NAMES, Axis, Degrees, WithDegrees
from forja.parallel.pp_split import stages_per_rank

# The layout's `parallel.*` keys, in the order a plan prints them: the degrees, cp's kind after
# cp, then the options (the rest of ParallelConfig is left as the recipe says).
PARALLEL_KEYS = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP, Axis.PP, Axis.CP, "cp_kind", Axis.EP,
                 "reshard_after_forward", "grad_sync", "cpu_offload", "sequence_parallel", "ac", "ac_every",
                 "ac_matmuls", "pp_schedule", "pp_microbatches")
OPTION_KEYS = tuple(k for k in PARALLEL_KEYS if not isinstance(k, Axis))
LAYOUT_KEYS = frozenset(PARALLEL_KEYS) | {"micro_batch_size"}
"""What `forja plan --layout` may hold: the layout's keys, by name without the section."""
# (ac, ac_every, ac_matmuls) the search tries: op-level selective keeping every matmul's output
# or every second one's (torchtitan's policy), between none and full.
AC_MODES = (("none", 0, "all"), ("selective", 0, "all"), ("selective", 0, "alternate"), ("full", 0, "all"))


@dataclass(frozen=True, kw_only=True)
class Layout(WithDegrees):
    """Degrees of each parallelism and the memory options of one candidate (`lay.tp`, `lay.dp`,
    ... read its degrees)."""

    degrees: Degrees = Degrees()
    """Ranks of each kind of parallelism, resolved (no dp_shard = -1)."""
    cp_kind: str = "ring"
    """Under cp > 1: "ring" (K/V passed around the cp ranks) or "all-to-all" (re-sharded over heads)."""
    reshard_after_forward: bool = True
    """ZeRO-3 (True) or ZeRO-2 (False) under FSDP."""
    grad_sync: str = "micro-batch"
    """FSDP's reduction: every micro-batch, or once a step with whole gradients held ("step")."""
    cpu_offload: bool = False
    """FSDP's parameters, gradients and optimizer state in host memory."""
    sequence_parallel: bool = True
    """With tp > 1: norms and residuals split along the sequence."""
    ac: str = "none"
    """Activation checkpointing: none, full or selective."""
    ac_every: int = 0
    """selective: every k-th block; 0: op-level."""
    ac_matmuls: str = "all"
    """op-level: keep every matmul's output, or every second mm's ("alternate")."""
    pp_schedule: str = "1f1b"
    """The pipeline schedule under pp > 1."""
    pp_microbatches: int = 0
    """0: local batch / micro_batch_size, as forja train counts them."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank."""

    @classmethod
    def of(cls, **values: Any) -> Layout:
        """A layout from its keys by name, degrees among them: Layout.of(dp_shard=8, tp=2, ac="full")."""
        return cls().with_values(**values)

    @classmethod
    def from_config(cls, parallel: ParallelConfig, micro_batch_size: int, world_size: int) -> Layout:
        """The layout a run's config asks for on `world_size` ranks (dp_shard = -1 resolved;
        a ForjaError when the degrees cannot make the world size)."""
        return cls(degrees=parallel.degrees.resolve(world_size), micro_batch_size=micro_batch_size,
                   **{k: getattr(parallel, k) for k in OPTION_KEYS})

    def with_values(self, **values: Any) -> Layout:
        """This layout with the keys given by name (degrees or options) changed."""
        degrees = {k: values.pop(k) for k in list(values) if k in AXIS_NAMES}
        return replace(self, degrees=replace(self.degrees, **degrees), **values)

    def parallel(self, base: ParallelConfig) -> ParallelConfig:
        """`base` (a recipe's `[parallel]`) with this layout's keys."""
        return replace(base.with_degrees(self.degrees), **{k: getattr(self, k) for k in OPTION_KEYS})

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.pp_schedule) if self.pp > 1 else 1

    def microbatches(self, global_batch_size: int) -> int:
        """Micro-batches one rank runs per step (the pipeline's, or gradient accumulation's)."""
        local = global_batch_size // self.dp
        return self.pp_microbatches if self.pp > 1 and self.pp_microbatches else max(1, local // self.micro_batch_size)

    def sequences_per_microbatch(self, global_batch_size: int) -> float:
        """Sequences in one micro-batch: micro_batch_size, or the local batch split into
        pp_microbatches when those are given."""
        if self.pp > 1 and self.pp_microbatches:
            return global_batch_size / self.dp / self.pp_microbatches
        return float(self.micro_batch_size)

    def overrides(self) -> dict[str, Any]:
        """The `--set` keys that select this layout in `forja train`."""
        out = {f"parallel.{k}": getattr(self, k) for k in PARALLEL_KEYS}
        out["train.micro_batch_size"] = self.micro_batch_size
        return out

    @property
    def sp_degree(self) -> int:
        """The ranks a block's sequence is split over outside its matmuls: tp under sequence
        parallelism, else 1."""
        return self.tp if self.tp > 1 and self.sequence_parallel else 1

    @property
    def op_level(self) -> bool:
        """Op-level selective AC (the only AC that reads ac_matmuls)."""
        return self.ac == "selective" and not self.ac_every

    @property
    def op_level_alternate(self) -> bool:
        """Op-level selective AC keeping every second mm's output (parallel.ac_matmuls)."""
        return self.op_level and self.ac_matmuls == "alternate"

    def describe(self) -> str:
        """A short name, e.g. 'dp_shard 8 x tp 8 x pp 4 | zero-3 | ac full | mbs 1 | 1f1b x 16' (a CP
        degree names its kind: 'cp 4 ring', 'cp 2 all-to-all')."""
        parts = [self.degrees.describe(self.cp_kind)]
        if self.fsdp > 1 or self.dp_replicate > 1:
            parts.append("zero-3" if self.reshard_after_forward else "zero-2")
            if self.grad_sync == "step":
                parts.append("grads/step")
        if self.cpu_offload:
            parts.append("offload")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("no sp")
        if self.ac != "none":
            parts.append(f"ac {self.ac}" + (f"/{self.ac_every}" if self.ac_every else "")
                         + (" (alternate mm)" if self.op_level_alternate else ""))
        parts.append(f"mbs {self.micro_batch_size}")
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}" + (f" x {self.pp_microbatches}" if self.pp_microbatches else ""))
        return " | ".join(parts)


    def short(self) -> str:
        """`describe()` for a table that fits 100 columns, e.g. 'hsdp 8x2 cp 4 a2a z3 ac sel mb 1',
        'fsdp 8 tp 8 pp 4 z3 mb 1 1f1b/16' (hsdp R x S: replicas x shards)."""
        r, s = self.dp_replicate, self.dp_shard
        parts = [f"hsdp {r}x{s}" if r > 1 and s > 1 else f"fsdp {s}" if s > 1 else f"ddp {r}" if r > 1 else ""]
        parts.append(f"tp {self.tp}" + ("" if self.sequence_parallel else " nosp") if self.tp > 1 else "")
        kind = "a2a" if self.cp_kind == "all-to-all" else self.cp_kind
        parts.append(f"cp {self.cp} {kind}" if self.cp > 1 else "")
        parts += [f"pp {self.pp}" if self.pp > 1 else "", f"ep {self.ep}" if self.ep > 1 else ""]
        if self.fsdp > 1:  # sharded: ZeRO-3 or ZeRO-2
            parts.append(("z3" if self.reshard_after_forward else "z2") + ("/step" if self.grad_sync == "step" else ""))
        parts.append("offload" if self.cpu_offload else "")
        every = f"/{self.ac_every}" if self.ac_every else ("/alt" if self.op_level_alternate else "")
        parts.append(f"ac {_AC_SHORT.get(self.ac, self.ac)}{every}" if self.ac != "none" else "")
        parts.append(f"mb {self.micro_batch_size}")
        if self.pp > 1:
            parts.append(_SCHEDULE_SHORT.get(self.pp_schedule, self.pp_schedule)
                         + (f"/{self.pp_microbatches}" if self.pp_microbatches else ""))
        return " ".join(p for p in parts if p)


_SCHEDULE_SHORT = {"interleaved-1f1b": "i1f1b", "zero-bubble": "zbv"}
_AC_SHORT = {"selective": "sel"}


def parse_layout(text: str, base: Layout) -> Layout:
    """'parallel.dp_shard=2,parallel.tp=2,train.micro_batch_size=4' on top of `base`."""
    return base.with_values(**parse_fixed(text))


def parse_fixed(text: str) -> dict[str, Any]:
    """The keys a `--layout` text gives, as Layout key -> value (the rest is left to the search).
    Each value is read as `--set` reads it (TOML, else a bare string: `parallel.ac=full` and
    `parallel.ac="full"` alike) and checked against what its key takes."""
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        name = key.strip().removeprefix("parallel.").removeprefix("train.")
        if not sep or name not in LAYOUT_KEYS:
            raise ForjaError(f"--layout item {item!r}: expected KEY=VALUE with KEY one of parallel.{{"
                             f"{', '.join(PARALLEL_KEYS)}}} or train.micro_batch_size")
        dotted = "train.micro_batch_size" if name == "micro_batch_size" else f"parallel.{name}"
        values[name] = coerce_key(dotted, parse_value(raw))
    _ = Degrees(**{k: v for k, v in values.items() if k in AXIS_NAMES})  # built to check each held degree
    return values


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the search may vary; the defaults are what an experienced user would try."""

    gpus_per_node: int = 8
    max_tp: int = 8
    """TP crosses no node boundary (its collectives sit on the critical path)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    pp_schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "zero-bubble")
    allow_cp: bool = True
    cp_kinds: tuple[str, ...] = CP_KINDS
    """The kinds of context parallelism tried for each cp > 1 (a held parallel.cp_kind: that one)."""
    allow_offload: bool = True
    fixed: tuple[tuple[str, Any], ...] = ()
    """Any Layout keys held fixed (a partial `forja plan --layout`), degrees or options alike,
    e.g. (("dp_shard", 8), ("ac", "full")): the search varies only the others."""

    def allows(self, **values: Any) -> bool:
        return all(values.get(k, v) == v for k, v in self.fixed)

    def options(self) -> dict[str, Any]:
        """The fixed keys that are not degrees nor searched lists: applied to every layout."""
        return {k: v for k, v in self.fixed if k not in AXIS_NAMES | {"micro_batch_size", "pp_schedule"}}

    def with_fixed(self, fixed: dict[str, Any]) -> SearchSpace:
        """This space with `fixed` held: a micro-batch size or schedule outside the default
        lists is searched as the only choice."""
        space = replace(self, fixed=tuple(fixed.items()))
        if "micro_batch_size" in fixed:
            space = replace(space, micro_batch_sizes=(fixed["micro_batch_size"],))
        if "pp_schedule" in fixed:
            space = replace(space, pp_schedules=(fixed["pp_schedule"],))
        if fixed.get("cp", 1) > 1:
            space = replace(space, allow_cp=True)
        if "cp_kind" in fixed:
            space = replace(space, cp_kinds=(fixed["cp_kind"],))
        if fixed.get("cpu_offload"):
            space = replace(space, allow_offload=True)
        return space


def enumerate_layouts(world: int, *, n_layers: int, n_heads: int, n_kv_heads: int, n_experts: int,
                      global_batch_size: int, seq_len: int, space: SearchSpace) -> Iterator[Layout]:
    """Every layout of `world` ranks whose degrees divide what they split: TP the heads (and KV
    heads), PP the layers, CP the sequence, EP the experts and dp_shard, DP the global batch.
    Each appears once; the layout validator then judges it (forja/parallel/checks.py)."""
    seen: set[Layout] = set()
    for lay in _layouts(world, n_layers, n_heads, n_kv_heads, n_experts, global_batch_size, seq_len, space):
        lay = replace(lay, **space.options())  # a fixed option holds for every layout
        if not lay.op_level and "ac_matmuls" not in dict(space.fixed):
            lay = replace(lay, ac_matmuls="all")  # only op-level AC reads it: one layout, not two
        if lay.grad_sync == "step" and "grad_sync" not in dict(space.fixed) and (
                lay.reshard_after_forward or lay.cpu_offload):
            continue  # "step" is ZeRO-2's, on the device (the validator's rule): not searched otherwise
        if lay not in seen:
            seen.add(lay)
            yield lay


def _layouts(world: int, n_layers: int, n_heads: int, n_kv_heads: int, n_experts: int, global_batch_size: int,
             seq_len: int, space: SearchSpace) -> Iterator[Layout]:
    # TP shards whole heads and whole KV heads (forja does not replicate KV heads over TP ranks).
    tps = [t for t in divisors(min(world, space.max_tp, space.gpus_per_node))
           if n_heads % t == 0 and n_kv_heads % t == 0]
    held = dict(space.fixed).get("tp")
    if held is not None and world % held == 0:
        tps = [held]  # a TP degree the user holds is judged (and refused, if so) by the validator, with its reason
    for tp, pp in itertools.product(tps, divisors(world)):
        if (world % (tp * pp)) or pp > n_layers or not space.allows(tp=tp, pp=pp):
            continue
        rest = world // (tp * pp)
        for cp in (divisors(rest) if space.allow_cp else [1]):
            dp = rest // cp
            if cp > 8 or global_batch_size % dp or not space.allows(cp=cp):
                continue
            for kind in _cp_kinds(cp, n_heads // tp, seq_len, space):
                for lay in _dp_splits(dp, tp, pp, cp, n_layers, n_experts, global_batch_size, space):
                    yield replace(lay, cp_kind=kind)


def _cp_kinds(cp: int, heads: int, seq_len: int, space: SearchSpace) -> list[str]:
    """The kinds of context parallelism a cp degree is tried with: ring needs 2 cp load-balanced
    chunks of the sequence; all-to-all splits a TP rank's `heads` over the cp ranks. A kind the
    user holds is tried whatever (the validator then says why it cannot run)."""
    if cp == 1:
        return ["ring"]  # the key's default: no context parallelism to choose a kind for
    held = "cp_kind" in dict(space.fixed)
    divides = {"ring": seq_len % (2 * cp) == 0, "all-to-all": seq_len % cp == 0 and heads % cp == 0}
    return [k for k in space.cp_kinds if held or divides.get(k, True)]


def _dp_splits(dp: int, tp: int, pp: int, cp: int, n_layers: int, n_experts: int, global_batch_size: int,
               space: SearchSpace) -> Iterator[Layout]:
    local = global_batch_size // dp
    node = space.gpus_per_node
    # Shard within a node's worth of ranks or over everything; replicate the rest (HSDP).
    shard_choices = {dp} | {s for s in divisors(dp) if s * tp * cp * pp <= node or s * tp * cp == node}
    for dp_shard in sorted(shard_choices):
        if not space.allows(dp_shard=dp_shard, dp_replicate=dp // dp_shard):
            continue
        # Expert parallelism runs without context parallelism (forja refuses the pair).
        eps = [e for e in divisors(dp_shard) if n_experts % e == 0 and (e == 1 or cp == 1)] if n_experts else [1]
        for ep, mbs in itertools.product(eps, space.micro_batch_sizes):
            if local % mbs or not space.allows(ep=ep):
                continue
            base = Layout(degrees=Degrees(dp_replicate=dp // dp_shard, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep),
                          micro_batch_size=mbs)
            yield from _memory_options(base, n_layers, local, space)


def _memory_options(base: Layout, n_layers: int, local: int, space: SearchSpace) -> Iterator[Layout]:
    schedules = [s for s in space.pp_schedules if n_layers >= base.pp * stages_per_rank(s)] if base.pp > 1 else ["1f1b"]
    zeros = (True, False) if base.fsdp > 1 else (True,)
    offloads = (False, True) if space.allow_offload and base.fsdp > 1 else (False,)
    # Reducing once a step matters only with gradient accumulation outside a pipeline, under ZeRO-2.
    syncs = ("micro-batch", "step") if base.fsdp > 1 and base.pp == 1 and local // base.micro_batch_size > 1 \
        else ("micro-batch",)
    for schedule, zero3, offload, sync, (ac, every, matmuls) in itertools.product(schedules, zeros, offloads, syncs,
                                                                                   AC_MODES):
        if base.pp > 1 and (local // base.micro_batch_size) < base.pp:
            continue  # fewer micro-batches than stages: the schedules refuse it
        yield replace(base, pp_schedule=schedule, reshard_after_forward=zero3, cpu_offload=offload, grad_sync=sync,
                      ac=ac, ac_every=every, ac_matmuls=matmuls)


def with_layout(cfg, lay: Layout):
    """`cfg` (a forja.config.Config) with the layout's parallel keys and micro-batch size."""
    train = dataclasses.replace(cfg.train, micro_batch_size=lay.micro_batch_size)
    return dataclasses.replace(cfg, parallel=lay.parallel(cfg.parallel), train=train)
