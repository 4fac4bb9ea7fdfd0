"""The `[data]` section of a training config: which data, and how it is prepared and read.

Batch sizes, sequence length and the sample-order seed live in `[train]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forja.errors import ForjaError

# Byte-level BPE starts from the 256 byte symbols; forja adds its 3 special tokens. Here, not in
# tokenizer.py, so that loading a config does not import the tokenizers library.
MIN_VOCAB_SIZE = 256 + 3


@dataclass(kw_only=True)
class StageConfig:
    """One `[[data.stages]]` table: from `start_step` on, the run trains on `path` (see docs/data.md)."""

    start_step: int
    """The first step (counted from 1) trained on this stage's data; stage 0 (data.path) starts at step 1."""
    path: str
    """A prepared directory, a mixture directory or a source/mixture spec, as data.path takes."""
    seq_len: int | None = None
    """This stage's sequence length (at most train.seq_len); None: train.seq_len_schedule / train.seq_len."""
    lr_phase: Literal["decay"] | None = None
    """"decay": a wsd schedule decays over this stage (to the next stage or train.steps), not over
    schedule.decay_fraction."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ForjaError(f"the data stage starting at step {self.start_step} has an empty path; give "
                             "a prepared directory or a source such as 'stdlib'")
        if self.seq_len is not None and self.seq_len < 1:
            raise ForjaError(f"the data stage starting at step {self.start_step} has seq_len = {self.seq_len}; "
                             "give a positive number of tokens or leave it out")


@dataclass(kw_only=True)
class DataConfig:
    """Where the training data comes from (see docs/data.md)."""

    path: str = "stdlib"
    """A prepared directory, a mixture directory, or a source spec (prepared on first use, cached in $FORJA_CACHE)."""
    tokenizer: str | None = None
    """tokenizer.json (or a directory holding one); None: the one beside prepared data, or one trained on the source."""
    vocab_size: int = 8192
    """Vocabulary of the tokenizer trained on the source when `tokenizer` is None."""
    val_fraction: float = 0.01
    """Share of documents in the validation split when a source is prepared on first use (one at least, of two)."""
    workers: int = 0
    """Tokenizer processes when preparing on first use; 0 means every core."""
    prefetch: int = 2
    """Optimizer steps of batches a background thread builds ahead; 0 builds each when asked."""
    stages: list[StageConfig] = field(default_factory=list)
    """Later stages of the run's data, [[data.stages]] tables with start_step and path; data.path is stage 0."""
    packing: Literal["window", "bos", "best-fit"] = "window"
    """How documents become samples: windows of the stream, samples from document starts, or best-fit with padding."""
    max_doc_tokens: int = 0
    """bos / best-fit: documents longer than this are split into pieces of it; 0 means seq_len + 1."""
    pack_buffer: int = 4096
    """best-fit: pieces packed together (consecutive in the stream); larger fits tighter."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ForjaError("data.path is empty; give a prepared directory or a source such as 'stdlib'")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ForjaError(f"data.vocab_size = {self.vocab_size} must be at least {MIN_VOCAB_SIZE}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ForjaError(f"data.val_fraction = {self.val_fraction} must be in [0, 1)")
        for key in ("workers", "prefetch", "max_doc_tokens"):
            if getattr(self, key) < 0:
                raise ForjaError(f"data.{key} = {getattr(self, key)} must be 0 or more")
        if self.pack_buffer < 1:
            raise ForjaError(f"data.pack_buffer = {self.pack_buffer} must be at least 1 piece")
        check_stages(self.stages)

    def stage_paths(self) -> list[str]:
        """Each stage's data, stage 0 (data.path) first."""
        return [self.path] + [s.path for s in self.stages]

    def stage_at(self, step: int) -> int:
        """The stage index of step `step` (counted from 1)."""
        return sum(1 for s in self.stages if s.start_step <= step)


def check_stages(stages: list[StageConfig]) -> None:
    """Stages start after step 1 (stage 0 is data.path) and in increasing order."""
    example = "e.g. --set 'data.stages=[{start_step=100, path=\"...\"}]'"
    steps = [s.start_step for s in stages]
    if steps and steps[0] < 2:
        raise ForjaError(f"data.stages[0].start_step = {steps[0]}: stage 0 is data.path, from step 1; a later "
                         f"stage starts at step 2 or after, {example}")
    for i in range(1, len(steps)):
        if steps[i] <= steps[i - 1]:
            raise ForjaError(f"data.stages[{i}].start_step = {steps[i]} must come after data.stages[{i - 1}]"
                             f".start_step = {steps[i - 1]}: list stages in the order they start")
