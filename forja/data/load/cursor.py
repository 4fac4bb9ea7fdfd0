"""Where the training loader's global order stands: per source, and in the current segment.

The order is cut into segments: a segment is a run of steps of one data stage at one sequence
length. Inside it, global position p (counted from the segment's start) picks a component of
the stage's mixture by weight (`order.Interleave`) and that component's own j-th draw of the
segment; the draw is the source's sample `base + j` of its own order, `base` being where the
source stood when the segment began. So each source keeps one order for the whole run, whatever
stages it belongs to: a sample consumed in one stage is never drawn again in another (until
that source's epoch ends), and what each source has contributed is counted here.

A source's position counts samples of one length and packing. When a segment starts at
another length (or packing), the source enters that order at ceil(tokens / T'): for window
packing the first window at or past the tokens it has given (docs/data.md, "sequence length").

Everything here is plain data: the cursor before a step is what a checkpoint records, and a
run resumed at step k with any world size continues from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class SourceCursor:
    """One source's consumption."""

    position: int = 0
    """Samples consumed, in the order of (seq_len, packing)."""
    seq_len: int = 0
    """The length `position` counts in; 0 before the source's first step."""
    packing: str = "window"
    tokens: int = 0
    """Input tokens this source has filled (each of its samples' T, padding included), every length."""

    def start(self, seq_len: int, packing: str) -> int:
        """The source's first position in the order of (seq_len, packing)."""
        if (seq_len, packing) == (self.seq_len, self.packing):
            return self.position
        return -(-self.tokens // seq_len)  # ceil: no token given twice in the stream's own order


@dataclass(frozen=True)
class Segment:
    """Steps of one stage at one length and batch size, from `start_steps` completed steps on."""

    stage: int
    seq_len: int
    packing: str
    batch: int
    """Samples per step (train.global_batch_size): a resume with another starts a new segment."""
    start_steps: int
    bases: tuple[int, ...]
    """Per component of the stage's mixture: its source's position when the segment began."""


@dataclass(frozen=True)
class Cursor:
    """The global order consumed by completed steps."""

    steps: int = 0
    sources: dict[str, SourceCursor] = field(default_factory=dict)
    """By source fingerprint."""
    segment: Segment | None = None
    """The segment of the last step taken (None before the first)."""

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sources.values())

    def source(self, fingerprint: str) -> SourceCursor:
        return self.sources.get(fingerprint, SourceCursor())

    def segment_for(self, stage: int, seq_len: int, packing: str, batch: int, fingerprints: list[str]) -> Segment:
        """The segment of the next step: the current one, or a new one from here."""
        seg = self.segment
        if seg is not None and (seg.stage, seg.seq_len, seg.packing, seg.batch) == (stage, seq_len, packing, batch):
            return seg
        bases = tuple(self.source(fp).start(seq_len, packing) for fp in fingerprints)
        return Segment(stage, seq_len, packing, batch, self.steps, bases)

    def after(self, segment: Segment, fingerprints: list[str], before: list[int], after: list[int]) -> Cursor:
        """The cursor once the step is taken: component j of the segment had drawn `before[j]`
        samples before the step and `after[j]` after it."""
        sources = dict(self.sources)
        for j, fp in enumerate(fingerprints):
            drawn = after[j] - before[j]
            if drawn == 0 and fp in sources:
                continue
            old = self.source(fp)
            sources[fp] = SourceCursor(position=segment.bases[j] + after[j], seq_len=segment.seq_len,
                                       packing=segment.packing, tokens=old.tokens + drawn * segment.seq_len)
        return replace(self, steps=self.steps + 1, sources=sources, segment=segment)

    # -- the checkpoint's form: JSON, so that its shape never depends on the sources ----------
    def to_json(self) -> str:
        seg = self.segment
        return json.dumps({
            "steps": self.steps,
            "sources": {fp: vars(s) for fp, s in sorted(self.sources.items())},
            "segment": None if seg is None else {**vars(seg), "bases": list(seg.bases)},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Cursor:
        data: dict[str, Any] = json.loads(text)
        seg = data.get("segment")
        segment = None if seg is None else Segment(**{**seg, "bases": tuple(seg["bases"])})
        return cls(steps=int(data["steps"]), sources={fp: SourceCursor(**s) for fp, s in data["sources"].items()},
                   segment=segment)
