"""The training data loader: deterministic, resumable at any data-parallel world size.

Samples are `seq_len + 1` tokens cut from a source's split by its packing (data.packing,
forja/data/load/packing.py): windows of the stream, samples from document starts, or whole
documents placed best-fit with padding.

The global order is a function of the seed alone. A run's data comes in stages (data.path,
then `[[data.stages]]`, forja/data/load/stages.py), each a mixture of sources; the order is cut into
segments of one stage at one length (forja/data/load/cursor.py). Position p of a segment picks a
component of the stage's mixture by weight (`order.Interleave`) and that source's next sample
q of its own order; epoch e = q // n of the source draws sample `Permutation(n, key(seed,
source, e))(q % n)`. So within an epoch of a source no sample repeats, every epoch is
reshuffled, and a source shared by two stages goes on where it was.

Step s of a segment is its positions [s*G, (s+1)*G), G = global_batch_size. Rank r of w takes
the contiguous block [s*G + r*G/w, s*G + (r+1)*G/w), cut in order into micro-batches of m. A
single process with G/m accumulation steps therefore sees exactly the union of all ranks.

The state is a global cursor, not a per-rank one: the steps taken, each source's position and
tokens, the current segment, and the stages begun. A run saved at step k with w ranks resumes
at step k with any w' and sees what an uninterrupted run would have seen; stages that have not
begun may be edited or appended in between, a begun one may not (it stops, naming it).

A new length T' (train.seq_len_schedule, a stage's seq_len, a resume at a longer train.seq_len)
starts a new segment in which each source enters the order of T'-samples at ceil(tokens / T'),
tokens being what it has given so far. For window packing that is the first T'-window starting
at or past the first token not yet consumed in the stream's own order: under the shuffle the
run's place in each source's epoch is kept to the token, and the rest of the epoch is the same
seed's permutation of the T'-windows from there (a T'-window overlaps T-windows seen and not,
so in the epoch of a change about the fraction already done is seen twice, as much not at all;
from the next epoch on, every token once per epoch again). A new global batch size on resume
starts a new segment the same way, exactly (positions are whole samples at one length).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from forja.data.corpus.prepare import cache_root
from forja.data.corpus.shards import PreparedDataset
from forja.data.load.batch import Batch, DataArg, as_mixture
from forja.data.load.cursor import Cursor, Segment, SourceCursor
from forja.data.load.order import Permutation, derive_key
from forja.data.load.packing import IGNORE, PACKINGS, PAD_DOCUMENT, Packing, build_packing
from forja.data.load.stages import Stage, StageSet
from forja.data.load.windows import Samples, ValidationLoader, too_short

__all__ = ["Batch", "DataArg", "DataLoader", "Samples", "Stage", "ValidationLoader", "as_mixture", "check_batch_sizes"]
from forja.errors import ForjaError

# A document id is its source's number in the high bits and its index (or piece) in the source
# below: ids stay distinct across the sources of a mixture and of every stage.
_SOURCE_SHIFT = 40


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_world_size: int) -> int:
    """Micro-batches per rank per step; stops with the config keys to change if it does not divide."""
    if global_batch_size < 1 or micro_batch_size < 1:
        raise ForjaError(f"train.global_batch_size ({global_batch_size}) and train.micro_batch_size "
                         f"({micro_batch_size}) must be positive numbers of samples")
    per_step = micro_batch_size * dp_world_size
    if global_batch_size % per_step:
        raise ForjaError(f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                         f"train.micro_batch_size ({micro_batch_size}) x data-parallel size ({dp_world_size}) "
                         f"= {per_step}; change train.global_batch_size or train.micro_batch_size")
    return global_batch_size // per_step


class DataLoader:
    """Micro-batches for one data-parallel rank, one optimizer step at a time.

    `next_step()` returns the list of `accumulation_steps` micro-batches of the next step;
    iterating the loader yields the same lists forever. Batches are built by a background
    thread `prefetch` steps ahead; `data_wait_s` is the time the caller spent blocked.
    `seq_len_at(steps)`, when given, is the sequence length of the step after `steps` steps
    (train.seq_len_schedule); else every step has `seq_len`. `stages` are the data stages
    after `data` (stage 0); `packing` one of forja.data.load.packing.PACKINGS.
    """

    def __init__(self, data: DataArg, *, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0, split: str = "train",
                 prefetch: int = 2, tokenizer: Any = None, pin_memory: bool = False,
                 seq_len_at: Callable[[int], int] | None = None, stages: Sequence[Stage] = (),
                 packing: str = "window", max_doc_tokens: int = 0, pack_buffer: int = 4096):
        if not 0 <= dp_rank < dp_world_size:
            raise ForjaError(f"data-parallel rank {dp_rank} is outside world size {dp_world_size}")
        if packing not in PACKINGS:
            raise ForjaError(f"data.packing = {packing!r} is not a packing; use one of {', '.join(PACKINGS)}")
        self.accumulation_steps = check_batch_sizes(global_batch_size, micro_batch_size, dp_world_size)
        all_stages = [Stage(1, data, None, _name(data))]
        all_stages += list(stages)
        self.stages = StageSet(all_stages, [as_mixture(s.data, tokenizer) for s in all_stages])
        self.mixture = self.stages.mixtures[0]
        self.seq_len_at = seq_len_at or (lambda steps: seq_len)
        self.seq_len, self.split, self.seed = seq_len, split, seed
        self.packing, self.max_doc_tokens, self.pack_buffer = packing, max_doc_tokens, pack_buffer
        self._packings: dict[tuple[int, int], Packing] = {}  # (source, seq_len) -> its samples
        self._perms: dict[tuple[int, int], Permutation] = {}
        self.samples = Samples(self.mixture, split, seq_len)  # stage 0 at the run's length: too short stops here
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.prefetch, self.pin_memory = max(0, prefetch), pin_memory
        self.cursor = Cursor()
        """The global order consumed by completed steps (what the state records)."""
        self._before: Cursor | None = None  # the cursor before the last next_step, for rewind_step
        self.data_wait_s = 0.0
        """Seconds `next_step` spent waiting for data, cumulative."""
        self._prefetcher: _Prefetcher | None = None

    # -- the order ------------------------------------------------------------------------------
    def _packing(self, source: int, seq_len: int) -> Packing:
        key = (source, seq_len)
        if key not in self._packings:
            dataset = self.stages.sources[source]
            stream = dataset.split(self.split)
            packed = build_packing(self.packing, stream, seq_len, max_doc_tokens=self.max_doc_tokens,
                                   buffer=self.pack_buffer, pad_id=_pad_id(dataset),
                                   cache=cache_root() / "packing" / f"{dataset.fingerprint[:24]}-{self.split}")
            if packed.count < 1:
                raise ForjaError(too_short(dataset, self.split, stream.num_tokens, seq_len))
            self._packings[key] = packed
        return self._packings[key]

    def _permutation(self, source: int, epoch: int, n: int) -> Permutation:
        if len(self._perms) > 64:
            self._perms = {}
        key = (source, epoch, n)
        if key not in self._perms:
            self._perms[key] = Permutation(n, derive_key("forja", self.seed, source, epoch))
        return self._perms[key]

    def segment(self, cursor: Cursor) -> Segment:
        """The segment of the step after `cursor`: its stage, length and where each source starts."""
        stage = self.stages.at(cursor.steps + 1)
        seq_len = self.stages.stages[stage].seq_len or self.seq_len_at(cursor.steps)
        return cursor.segment_for(stage, seq_len, self.packing, self.global_batch_size,
                                  self.stages.component_fingerprints(stage))

    def _draws(self, segment: Segment, positions: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Segment positions -> per source drawn: (source, rows among `positions`, sample index)."""
        component, local = self.stages.interleaves[segment.stage].locate(positions)
        out = []
        for j in np.unique(component).tolist():
            rows = np.flatnonzero(component == j)
            source = self.stages.components[segment.stage][j]
            packed = self._packing(source, segment.seq_len)
            epoch, index = np.divmod(segment.bases[j] + local[rows], packed.count)
            for e in np.unique(epoch).tolist():
                where = epoch == e
                index[where] = self._permutation(source, e, packed.count)(index[where])
            out.append((source, rows, index))
        return out

    def _rows(self, segment: Segment, draws: list[tuple[int, np.ndarray, np.ndarray]],
              n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The `n` samples `draws` names: tokens and document ids (n, T + 1), pieces and cut (n,)."""
        T = segment.seq_len
        tokens = np.empty((n, T + 1), dtype=np.int64)
        docs = np.empty((n, T + 1), dtype=np.int64)
        pieces, cut = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for source, rows, index in draws:
            got = self._packing(source, T).rows(index)
            tokens[rows] = got.tokens
            docs[rows] = np.where(got.docs == PAD_DOCUMENT, PAD_DOCUMENT, got.docs + (source << _SOURCE_SHIFT))
            pieces[rows], cut[rows] = got.pieces, got.cut
        return tokens, docs, pieces, cut

    def build_step(self, cursor: Cursor) -> list[Batch]:
        """This rank's micro-batches of the global batch of the step after `cursor`: its block
        of positions drawn at once, then cut in order into micro-batches."""
        segment = self.segment(cursor)
        start = (cursor.steps - segment.start_steps) * self.global_batch_size
        per_rank = self.global_batch_size // self.dp_world_size
        first = start + self.dp_rank * per_rank
        step_labels = self.global_batch_size * segment.seq_len
        if self.packing == "best-fit":
            # Labels of padding train nothing, and the loss is over the rest of the whole global
            # batch: every rank's samples are drawn (once), this rank's rows taken from them.
            draws = self._draws(segment, np.arange(start, start + self.global_batch_size))
            step_labels -= sum(int(self._packing(src, segment.seq_len).padding(index).sum()) for src, _, index in draws)
            lo = first - start
            kept = [(src, rows, index, (rows >= lo) & (rows < lo + per_rank)) for src, rows, index in draws]
            draws = [(src, rows[k] - lo, index[k]) for src, rows, index, k in kept if k.any()]
        else:
            draws = self._draws(segment, np.arange(first, first + per_rank))
        tokens, docs, pieces, cut = self._rows(segment, draws, per_rank)
        t = torch.from_numpy(tokens)
        labels = t[:, 1:].clone()
        labels[torch.from_numpy(docs[:, 1:] == PAD_DOCUMENT)] = IGNORE
        ids = torch.from_numpy(docs[:, :-1])
        m = self.micro_batch_size
        steps = []
        for j in range(0, per_rank, m):
            # Contiguous copies: losses call .view(-1) on labels, which a strided slice refuses.
            batch = Batch(t[j:j + m, :-1].contiguous(), labels[j:j + m].contiguous(), ids[j:j + m].contiguous(),
                          step_labels=step_labels, documents=int(pieces[j:j + m].sum()),
                          cut_documents=int(cut[j:j + m].sum()))  # (m, T) each
            steps.append(batch.pinned() if self.pin_memory and torch.cuda.is_available() else batch)
        return steps

    def _advance(self, cursor: Cursor) -> Cursor:
        segment = self.segment(cursor)
        start = (cursor.steps - segment.start_steps) * self.global_batch_size
        interleave = self.stages.interleaves[segment.stage]
        before, after = interleave.count(start), interleave.count(start + self.global_batch_size)
        return cursor.after(segment, self.stages.component_fingerprints(segment.stage),
                            before.tolist(), after.tolist())

    # -- what the trainer reads --------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Tokens of the global order consumed by completed steps."""
        return self.cursor.tokens

    @property
    def stage(self) -> int:
        """The stage of the last step taken (of the next one before any)."""
        return self.stages.at(max(self.cursor.steps, 1))

    def source_tokens(self) -> dict[str, int]:
        """Input tokens each source has filled so far, by its label (its spec)."""
        return {label: self.cursor.source(fp).tokens
                for label, fp in zip(self.stages.labels, self.stages.fingerprints, strict=True)}

    def step_metrics(self, batches: Sequence[Batch]) -> dict[str, float]:
        """The data record of a step just returned: its stage, the share of padding (of the whole
        global batch) and of documents cut (this rank's samples), tokens per source so far."""
        tokens = sum(b.num_tokens for b in batches) * self.dp_world_size
        documents = sum(b.documents for b in batches)
        record: dict[str, float] = {"stage": self.stage,
                                    "data/padding": 1 - batches[0].step_labels / max(tokens, 1),
                                    "data/cut_docs": sum(b.cut_documents for b in batches) / max(documents, 1)}
        record |= {f"tokens/{label}": n for label, n in self.source_tokens().items()}
        return record

    @property
    def samples_per_epoch(self) -> int:
        return self.samples.samples_per_epoch

    def next_seq_len(self) -> int:
        """The sequence length of the next step."""
        return self.segment(self.cursor).seq_len

    # -- stepping ---------------------------------------------------------------------------
    def next_step(self, share: int = 0, shares: int = 1) -> list[Batch]:
        """The micro-batches of the next optimizer step (a list of accumulation_steps). With
        fault-tolerant replica groups (forja/train/ft) a loader step is one group's share of the
        global batch: this group trains share `share` of the `shares` the live groups train
        together, and the cursor moves past all of them."""
        if shares > 1:
            return self._next_share(share, shares)
        started = time.perf_counter()
        if self.prefetch == 0:
            batches = self.build_step(self.cursor)
        else:
            if self._prefetcher is None:
                self._prefetcher = _Prefetcher(self.build_step, self._advance, self.cursor, self.prefetch)
            try:
                at, batches = self._prefetcher.get()
            except BaseException:
                self.close()  # its thread has ended: the next call starts afresh or fails the same way
                raise
            assert at == self.cursor, "prefetcher out of step with the loader"
        self.data_wait_s += time.perf_counter() - started
        self._before, self.cursor = self.cursor, self._advance(self.cursor)
        return batches

    def _next_share(self, share: int, shares: int) -> list[Batch]:
        if not 0 <= share < shares:
            raise ValueError(f"share {share} of {shares}")
        started = time.perf_counter()
        self.close()  # a prefetcher builds consecutive steps, not one share in every `shares`
        cursors = [self.cursor]  # before each share of the step, then after the last
        for _ in range(shares):
            cursors.append(self._advance(cursors[-1]))
        batches = self.build_step(cursors[share])
        self.data_wait_s += time.perf_counter() - started
        self._before, self.cursor = self.cursor, cursors[-1]
        return batches

    def rewind_step(self) -> None:
        """Give back the step `next_step` just returned: it will be returned again (a step the
        run stopped before taking must not count as consumed)."""
        assert self._before is not None, "rewind_step without a step to give back"
        self.close()
        self.cursor, self._before = self._before, None

    def skip_steps(self, n: int) -> None:
        """Pass over the data of the next `n` steps without building it (a bad batch's window)."""
        self.close()  # the prefetcher was building those steps
        for _ in range(n):
            self.cursor = self._advance(self.cursor)

    def __iter__(self) -> Iterator[list[Batch]]:
        while True:
            yield self.next_step()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global cursor (as JSON: its shape must not depend on the sources), the stages
        begun, and what a resume must match. `position`, `tokens` and `seq_len` are kept for
        tools that read them."""
        c = self.cursor
        seg = c.segment
        return {"progress": c.to_json(), "stages": self.stages.history(c.steps), "steps": c.steps,
                "position": 0 if seg is None else (c.steps - seg.start_steps) * seg.batch,
                "tokens": c.tokens, "seq_len": 0 if seg is None else seg.seq_len,
                "seed": self.seed, "split": self.split, "data_fingerprint": self.mixture.fingerprint,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved cursor; any data-parallel world size works, any sequence length
        and batch size (a new segment from the tokens consumed: forja/data/load/cursor.py), and stages
        edited after the point reached (forja/data/load/stages.py checks the rest)."""
        for key, mine in (("seed", self.seed), ("split", self.split)):
            if state.get(key) != mine:
                raise ForjaError(f"the checkpoint's data loader state has {key} {state.get(key)!r} but this run "
                                 f"has {mine!r}; resume with the same data settings or start a new run")
        if "progress" in state:
            cursor = Cursor.from_json(state["progress"])
            self.stages.check_history(state["stages"], cursor.steps)
        else:
            cursor = self._legacy_cursor(state)
        self.close()
        self.cursor, self._before = cursor, None

    def _legacy_cursor(self, state: dict[str, Any]) -> Cursor:
        """A state saved before stages: one global position in stage 0's order (and, before the
        cursor held steps and tokens, one length all along)."""
        if state.get("data_fingerprint") != self.mixture.fingerprint:
            raise ForjaError(f"the checkpoint's data loader state has data_fingerprint "
                             f"{state.get('data_fingerprint')!r} but this run has {self.mixture.fingerprint!r}; "
                             "resume with the same data settings or start a new run")
        position, seq_len = int(state["position"]), int(state["seq_len"])
        batch = int(state.get("global_batch_size", self.global_batch_size))
        steps = int(state.get("steps", position // batch))
        counts = self.stages.interleaves[0].count(position).tolist()
        fingerprints = self.stages.component_fingerprints(0)
        sources = {fp: SourceCursor(position=n, seq_len=seq_len, tokens=n * seq_len)
                   for fp, n in zip(fingerprints, counts, strict=True)}
        segment = Segment(0, seq_len, "window", batch, steps - position // batch, (0,) * len(fingerprints))
        return Cursor(steps=steps, sources=sources, segment=segment)

    def close(self) -> None:
        """Stop the prefetch thread (it restarts at the current position when needed)."""
        prefetcher = getattr(self, "_prefetcher", None)  # None too if __init__ failed early
        if prefetcher is not None:
            prefetcher.stop()
            self._prefetcher = None

    def __del__(self) -> None:
        self.close()


def _name(data: DataArg) -> str:
    if isinstance(data, (str, os.PathLike)):
        return str(data)
    datasets = getattr(data, "datasets", None) or [getattr(data, "name", "the data")]
    return ", ".join(getattr(d, "name", str(d)) for d in datasets)


def _pad_id(dataset: PreparedDataset) -> int:
    tok = dataset.meta["tokenizer"]
    return int(tok["pad_id"] if tok.get("pad_id") is not None else tok["eos_id"])


class _Prefetcher:
    """A thread building steps ahead into a bounded queue, in order.

    It holds its loader's methods weakly: a loader nobody holds any more is collected and its
    thread ends, instead of the thread keeping it (and itself) alive for the process's life."""

    def __init__(self, build: Any, advance: Any, start: Cursor, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(weakref.WeakMethod(build),
                                        weakref.WeakMethod(advance), start), daemon=True, name="forja-data-prefetch")
        self._thread.start()

    def _run(self, build_ref: Any, advance_ref: Any, cursor: Cursor) -> None:
        while not self._stop.is_set():
            build, advance = build_ref(), advance_ref()
            if build is None or advance is None:
                return  # the loader is gone
            try:
                item: Any = (cursor, build(cursor))
                cursor = advance(cursor)
            except BaseException as exc:  # handed to the consumer, which raises it
                item = exc
            del build, advance  # no strong reference while waiting on the queue
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def get(self) -> tuple[Cursor, list[Batch]]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:  # a loader collected on this thread: it just ends
            self._thread.join(timeout=10)
