"""The [run], [train] and [debug] sections of a config (debug.inject's drill grammar with them)."""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from forja.errors import ForjaError


@dataclass(kw_only=True)
class RunConfig:
    """Where a run lives and what it is called."""

    dir: str = "runs/default"
    """Run directory: resolved config, checkpoints, metrics, samples. Rerunning on it resumes."""
    name: str | None = None
    """Name shown by trackers and reports; None means the run directory's name."""
    start_over: bool = False
    """Begin afresh in a run directory that holds another run (its checkpoints are deleted)."""


SPIKE_METRICS = ("loss", "grad_norm")


@dataclass(kw_only=True)
class SpikeConfig:
    """[train.spike]: a loss or gradient norm far above its recent values (forja/train/resilience/health.py)."""

    action: Literal["off", "skip", "rollback", "stop"] = "off"
    """What a spike does: off (not watched), skip the optimizer step, rollback to the last checkpoint
    (see [train.rollback]), or stop the run."""
    window: int = 100
    """Accepted steps whose values make the rolling mean and standard deviation."""
    threshold: float = 6.0
    """A value more than this many standard deviations above the rolling mean is a spike."""
    min_steps: int = 20
    """Values needed in the window before any step is judged (the first steps fall fast)."""
    metrics: list[str] = field(default_factory=lambda: list(SPIKE_METRICS))
    """Which values are watched: loss, grad_norm or both."""

    def __post_init__(self) -> None:
        if self.window < 2 or not 2 <= self.min_steps <= self.window:
            raise ForjaError(f"train.spike: window = {self.window} and min_steps = {self.min_steps} need "
                             "2 <= min_steps <= window")
        if not self.threshold > 0:
            raise ForjaError(f"train.spike.threshold = {self.threshold} must be > 0 (standard deviations)")
        bad = [m for m in self.metrics if m not in SPIKE_METRICS]
        if bad or not self.metrics:
            raise ForjaError(f"train.spike.metrics = {self.metrics}: choose from {', '.join(SPIKE_METRICS)}")


@dataclass(kw_only=True)
class RollbackConfig:
    """[train.rollback]: how a run goes back to its last checkpoint after a non-finite value or a
    spike (train.on_nonfinite or train.spike.action = "rollback")."""

    max: int = 3
    """Rollbacks allowed in one run; the next anomaly then stops it, so a run never loops."""
    skip_steps: int = 1
    """When the anomaly comes back on replay (a bad batch), the global batches skipped from there."""
    lr_scale: float = 1.0
    """After a rollback, the learning rate is multiplied by this ..."""
    lr_steps: int = 0
    """... for this many steps from the bad step on (0: the learning rate is left alone)."""

    def __post_init__(self) -> None:
        if self.max < 0 or self.skip_steps < 1 or self.lr_steps < 0:
            raise ForjaError("train.rollback: max and lr_steps must be >= 0, skip_steps >= 1")
        if not 0 < self.lr_scale <= 1:
            raise ForjaError(f"train.rollback.lr_scale = {self.lr_scale} must be in (0, 1]")


# The grammar of a debug.inject entry (forja/train/resilience/drills.py acts the drills out). It is
# parsed here, at the config's floor, so [debug] refuses a bad entry at load time.
DRILL_KINDS = ("nan", "spike", "kill", "hang", "slow", "bitflip", "gradflip", "actflip", "slowsave")
_DRILL_SPEC = re.compile(r"(?P<kind>[a-z]+)@(?P<step>\d+)(?P<opts>(:[a-z]+(=[0-9.]+)?)*)")
_DRILL_GRAMMAR = "KIND@STEP[:rank=R][:group=G][:repeat][:seconds=S] with KIND one of " + ", ".join(DRILL_KINDS)


@dataclass(frozen=True)
class Drill:
    spec: str
    kind: str
    step: int
    rank: int | None
    """None: every rank."""
    repeat: bool = False
    seconds: float = 0.2
    group: int | None = None
    """A fault-tolerant replica group (forja/train/ft), or None: any process."""

    def applies(self, rank: int, group: int | None = None) -> bool:
        return (self.rank is None or self.rank == rank) and (self.group is None or self.group == group)


def parse_drill(spec: str) -> Drill:
    """A `debug.inject` entry as a Drill; one clear error for anything else."""
    m = _DRILL_SPEC.fullmatch(spec.strip())
    if m is None or m["kind"] not in DRILL_KINDS:
        raise ForjaError(f"debug.inject entry {spec!r} is not a drill: write {_DRILL_GRAMMAR}, "
                         "e.g. 'kill@10:rank=1'")
    opts = dict(o.partition("=")[::2] for o in m["opts"].split(":")[1:])
    unknown = set(opts) - {"rank", "group", "repeat", "seconds"}
    if unknown or int(m["step"]) < 1:
        raise ForjaError(f"debug.inject entry {spec!r}: steps count from 1 and the options are rank=R, group=G, "
                         f"repeat and seconds=S ({_DRILL_GRAMMAR})")
    kind = m["kind"]
    rank = int(float(opts["rank"])) if opts.get("rank") else (None if kind in ("nan", "spike") else 0)
    return Drill(spec=spec.strip(), kind=kind, step=int(m["step"]), rank=rank, repeat="repeat" in opts,
                 seconds=float(opts.get("seconds") or 0.2),
                 group=int(float(opts["group"])) if opts.get("group") else None)


@dataclass(kw_only=True)
class DebugConfig:
    """[debug]: drills that make a run fail on purpose, to try how it recovers. Taken only from
    `--set` (a recipe or run config holding them is refused) and never saved with the run."""

    inject: list[str] = field(default_factory=list)
    """Faults to inject, each KIND@STEP[:rank=R][:group=G][:repeat][:seconds=S] with KIND nan, spike,
    kill, hang, slow, bitflip, gradflip, actflip or slowsave (forja/train/resilience/drills.py); empty: none."""

    def __post_init__(self) -> None:
        for spec in self.inject:
            parse_drill(spec)


@dataclass(kw_only=True)
class TrainConfig:
    """The optimization loop."""

    steps: int = 1000
    """Optimizer steps to train for (the schedule spans them)."""
    seed: int = 0
    """Seed of the weights, the data order and everything random."""
    seq_len: int = 512
    """Tokens per training sequence: the run's full length, the one validation, the layout and the
    memory check use; a resume may raise it (context extension: the data continues from the tokens
    consumed, docs/training.md)."""
    seq_len_schedule: list[list[int]] = field(default_factory=list)
    """A sequence-length warmup: [[step, length], ...], each length taking effect once `step` steps are
    done (the first entry at step 0, steps increasing, the last length = train.seq_len), e.g.
    [[0, 1024], [1000, 4096]]; empty: train.seq_len throughout. The global batch stays
    global_batch_size sequences, so tokens per step grow with the length."""
    seq_len_schedule_kind: Literal["step", "linear"] = "step"
    """step: each entry's length holds until the next entry; linear: the length ramps from each entry to
    the next, in multiples of the greatest common divisor of the listed lengths (so whatever divides
    every listed length divides every length used)."""
    global_batch_size: int = 32
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; accumulation makes up the rest."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision: auto = bf16 autocast on GPU, fp32 on CPU; fp16 = float16 autocast with dynamic
    loss scaling (for GPUs without bf16)."""
    fp16_init_scale: float = 65536.0
    """fp16: the loss scale to start from, a power of two; halved at each overflow."""
    fp16_growth_interval: int = 2000
    """fp16: the loss scale doubles after this many steps in a row without overflow."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto = CUDA when available."""
    val_interval: int = 100
    """Steps between validation passes (also at the end); 0 turns validation off."""
    val_batches: int = 8
    """Micro-batches per rank in one validation pass."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """float8 matmuls in Linear layers through torchao (emulated on CPU)."""
    float8_min_features: int = 1024
    """Linear layers with fewer input or output features stay high precision: too small to gain."""
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    """A NaN/inf loss or gradient norm: stop (the last checkpoint stays intact), skip the step and
    count it, or roll back to the last checkpoint ([train.rollback])."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Loss and gradient-norm spikes ([train.spike])."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    """Rollbacks ([train.rollback])."""
    sample_tokens: int = 64
    """Tokens of text generated into the run directory at the end; 0 turns it off."""
    sample_prompt: str = "def "
    """Prompt of that sample."""
    gc_interval: int = 50
    """Run Python's garbage collector every this many steps (and only then); 0 leaves it automatic."""
    profile_at: int = 0
    """Record a torch.profiler trace of 3 steps from this step into <run.dir>/profile; 0: off."""
    host_malloc: Literal["retain", "system"] = "retain"
    """What malloc does with host memory a step frees (forja/host.py): retain keeps it mapped for
    the next step (glibc), so a CPU step does not fault in and zero its activations afresh; system
    leaves the C library's defaults (large blocks returned to the OS at once)."""

    def __post_init__(self) -> None:
        for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ForjaError(f"train.{key} = {getattr(self, key)} must be at least 1")
        if self.grad_clip < 0:
            raise ForjaError(f"train.grad_clip = {self.grad_clip} must be >= 0 (0 turns clipping off)")
        if not (self.fp16_init_scale >= 1 and math.log2(self.fp16_init_scale).is_integer()):
            raise ForjaError(f"train.fp16_init_scale = {self.fp16_init_scale} must be a power of two >= 1 "
                             "(such as 65536.0), so that scaling is exact")
        if self.fp16_growth_interval < 1:
            raise ForjaError(f"train.fp16_growth_interval = {self.fp16_growth_interval} must be at least 1")
        check_seq_len_schedule(self.seq_len_schedule, self.seq_len)

    def seq_len_at(self, steps: int) -> int:
        """The sequence length of the step after `steps` completed steps."""
        table = self.seq_len_schedule
        if not table:
            return self.seq_len
        i = bisect.bisect_right([s for s, _ in table], steps) - 1
        step, length = table[i]
        if self.seq_len_schedule_kind == "step" or i + 1 == len(table):
            return length
        next_step, next_length = table[i + 1]
        g = math.gcd(*(n for _, n in table))
        # Integer arithmetic: every rank and every resume computes the same length.
        return length + g * ((next_length - length) // g * (steps - step) // (next_step - step))

    def seq_lens(self) -> tuple[int, ...]:
        """Every sequence length the run's train.steps steps use, ascending: each must pass the
        layout's divisibility checks (forja/parallel/checks.py), not train.seq_len alone."""
        table = self.seq_len_schedule
        if not table:
            return (self.seq_len,)
        used = {n for s, n in table if s < self.steps} | {self.seq_len}
        if self.seq_len_schedule_kind == "linear":  # each ramp's lengths: at most (its rise / gcd) + 1 of them
            for (start, _), (end, _) in zip(table, table[1:]):
                used |= {self.seq_len_at(s) for s in range(start, min(end, self.steps))}
        return tuple(sorted(used))


def check_seq_len_schedule(table: list[list[int]], seq_len: int) -> None:
    """train.seq_len_schedule: [step, length] pairs from step 0, steps increasing, lengths
    positive, ending at train.seq_len; stops with the key and the fix."""
    if not table:
        return
    example = f"e.g. [[0, {max(1, seq_len // 4)}], [1000, {seq_len}]]"
    if any(len(entry) != 2 for entry in table):
        raise ForjaError(f"train.seq_len_schedule = {table}: each entry must be [step, length], {example}")
    steps, lengths = [s for s, _ in table], [n for _, n in table]
    if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ForjaError(f"train.seq_len_schedule steps {steps} must start at 0 and increase, {example}")
    if min(lengths) < 1:
        raise ForjaError(f"train.seq_len_schedule lengths {lengths} must be positive numbers of tokens")
    if lengths[-1] != seq_len:
        raise ForjaError(f"train.seq_len_schedule ends at length {lengths[-1]} but train.seq_len = {seq_len}; "
                         f"end the schedule at train.seq_len (the length validation and the layout use)")
