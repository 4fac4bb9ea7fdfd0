"""The [run] and [train] sections of a config."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(kw_only=True)
class TrainConfig:
    """The optimization loop."""

    steps: int = 1000
    """Optimizer steps to train for (the schedule spans them)."""
    seed: int = 0
    """Seed of the weights, the data order and everything random."""
    seq_len: int = 512
    """Tokens per training sequence."""
    global_batch_size: int = 32
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; accumulation makes up the rest."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: auto = bf16 autocast on GPU, fp32 on CPU."""
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
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss: stop (the last checkpoint stays intact) or skip the step and count it."""
    sample_tokens: int = 64
    """Tokens of text generated into the run directory at the end; 0 turns it off."""
    sample_prompt: str = "def "
    """Prompt of that sample."""
    gc_interval: int = 50
    """Run Python's garbage collector every this many steps (and only then); 0 leaves it automatic."""
    profile_at: int = 0
    """Record a torch.profiler trace of 3 steps from this step into <run.dir>/profile; 0: off."""

    def __post_init__(self) -> None:
        for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ForjaError(f"train.{key} = {getattr(self, key)} must be at least 1")
        if self.grad_clip < 0:
            raise ForjaError(f"train.grad_clip = {self.grad_clip} must be >= 0 (0 turns clipping off)")
