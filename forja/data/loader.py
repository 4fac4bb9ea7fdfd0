"""The training data loader: deterministic, resumable at any data-parallel world size.

Samples are fixed windows of `seq_len + 1` tokens of a split's token stream (documents packed
back to back): sample i covers tokens [i*seq_len, i*seq_len + seq_len], so consecutive
samples share one token and every token but the first is a label exactly once per epoch.

The global order is a function of the seed alone. Global position p (0, 1, 2, ...) picks a
dataset of the mixture (`order.Interleave`, by weight) and that dataset's own position q;
epoch e = q // n of that dataset draws sample `Permutation(n, key(seed, dataset, e))(q % n)`.
So within an epoch no sample repeats, and every epoch is reshuffled.

Global step s is positions [s*G, (s+1)*G), G = global_batch_size. Rank r of w takes the
contiguous block [s*G + r*G/w, s*G + (r+1)*G/w), cut in order into micro-batches of m. A
single process with G/m accumulation steps therefore sees exactly the union of all ranks.

The state is a global cursor, not a per-rank one: the steps taken, the position in the order of
the current seq_len and the tokens consumed. A run saved at step k with w ranks resumes at step
k with any w' and sees what an uninterrupted run would have seen (for the same seed, data,
global batch size and sequence lengths).

The sequence length may change between steps (`seq_len_at`, train.seq_len_schedule) or between
launches (a run resumed with a longer train.seq_len). A new length T' starts a new segment of
the order: the order of T'-windows of the same seed, entered at position ceil(tokens / T'),
tokens being every token consumed so far (the sum of each step's G x T). That is the exact
token position in this sense: in the stream's own order (unshuffled) window p of length T
starts at token p * T, so the first T'-window taken is the one starting at the first token not
yet consumed, rounded up to a whole window (fewer than T' tokens passed over, none repeated);
under the shuffle, the run's place in the epoch is kept to the token (an epoch of either length
holds the same tokens, so the epoch ends where it would have), and the rest of the epoch is the
same seed's permutation of the T'-windows from there. What the shuffle does not give is the
complement of the T-windows already seen: a T'-window overlaps T-windows both seen and not,
and only cutting the unseen ones into pieces would avoid that -- which splits documents at
random, the opposite of what a longer context is for. So in the epoch of a change about the
fraction of it already done is seen twice, as much not at all; from the next epoch on, every
token once per epoch again. Every step of a segment is a whole global batch of G sequences
of one length: the batch is fixed in sequences, so tokens per step follow the length.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from forja.data.mixture import Mixture
from forja.data.order import Interleave, Permutation, derive_key
from forja.data.prepare import open_dataset
from forja.data.shards import PreparedDataset
from forja.errors import ForjaError


@dataclass
class Batch:
    """One micro-batch: (m, T) int64 tensors."""

    input_ids: torch.Tensor
    """Token ids, (m, T)."""
    labels: torch.Tensor
    """The next token of each position, (m, T)."""
    document_ids: torch.Tensor
    """Per-token document index, (m, T): equal ids are one document (attention stays within)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking)
                       for t in (self.input_ids, self.labels, self.document_ids)))


DataArg = PreparedDataset | Mixture | str | os.PathLike[str] | Sequence[tuple[Any, float]]


def as_mixture(data: DataArg, tokenizer: Any = None) -> Mixture:
    """A Mixture from a dataset, a Mixture, a path or source spec, or (data, weight) pairs."""
    if isinstance(data, (str, os.PathLike)):
        mixture = Mixture.of(open_dataset(data, tokenizer))
    elif isinstance(data, (PreparedDataset, Mixture)):
        mixture = Mixture.of(data)
    else:
        mixture = Mixture.of([(_single(d, tokenizer), w) for d, w in data])
    if tokenizer is not None:
        mixture.check_tokenizer(tokenizer)
    return mixture


def _single(data: Any, tokenizer: Any) -> PreparedDataset:
    if isinstance(data, PreparedDataset):
        return data
    datasets = as_mixture(data, tokenizer).datasets
    if len(datasets) != 1:
        raise ForjaError(f"a part of a mixture cannot itself be a mixture ({data}); list its parts instead")
    return datasets[0]


def _too_short(dataset: PreparedDataset, split: str, tokens: int, seq_len: int) -> str:
    """Why `split` of `dataset` holds no sample of seq_len + 1 tokens, and what to do."""
    without = "or set train.val_interval = 0 to train without validation"
    if split != "val":
        return (f"the {split} split of {dataset.name} has {tokens} tokens, too few for one sample of "
                f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len or add data")
    if tokens == 0:
        fraction, documents = dataset.meta.get("val_fraction", 0), dataset.meta["source"]["documents"]
        if not fraction:
            why, fix = "it was prepared with a validation fraction of 0", "prepare it with one above 0"
        elif documents == 1:
            why, fix = "its only document went to training", "add documents"
        else:  # prepared by a forja that let a small corpus leave validation empty
            why, fix = f"none of its {documents} documents went to it", dataset.redo
        return f"the validation split of {dataset.name} is empty ({why}); {fix}, {without}"
    return (f"the validation split of {dataset.name} has {tokens} tokens, too few for one sample of "
            f"train.seq_len + 1 = {seq_len + 1}; lower train.seq_len, prepare it with a larger validation "
            f"fraction (data.val_fraction), {without}")


class Samples:
    """Global positions of one split of a mixture -> micro-batches."""

    def __init__(self, mixture: Mixture, split: str, seq_len: int):
        if seq_len < 1:
            raise ForjaError(f"seq_len {seq_len} must be a positive number of tokens")
        self.seq_len = seq_len
        self.streams = [d.split(split) for d in mixture.datasets]
        self.counts = [(s.num_tokens - 1) // seq_len for s in self.streams]
        for dataset, stream, count in zip(mixture.datasets, self.streams, self.counts, strict=True):
            if count < 1:
                raise ForjaError(_too_short(dataset, split, stream.num_tokens, seq_len))
        # Document ids are made unique across the datasets of a mixture.
        self.doc_base = np.cumsum([0] + [s.num_documents for s in self.streams])
        self.interleave = Interleave(mixture.weights)
        self._perms: dict[tuple[int, int], Permutation] = {}
        self._seed: int | None = None

    @property
    def samples_per_epoch(self) -> int:
        return sum(self.counts)

    def locate(self, positions: np.ndarray, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Global positions -> (dataset, sample index); seed None means unshuffled."""
        dataset, local = self.interleave.locate(positions)
        counts = np.asarray(self.counts, dtype=np.int64)[dataset]
        epoch, index = np.divmod(local, counts)
        if seed is None:
            return dataset, index
        for d, e in sorted(set(zip(dataset.tolist(), epoch.tolist(), strict=True))):
            where = (dataset == d) & (epoch == e)
            index[where] = self._permutation(seed, d, e)(index[where])
        return dataset, index

    def _permutation(self, seed: int, dataset: int, epoch: int) -> Permutation:
        if self._seed != seed or len(self._perms) > 64:
            self._perms, self._seed = {}, seed
        key = (dataset, epoch)
        if key not in self._perms:
            self._perms[key] = Permutation(self.counts[dataset], derive_key("forja", seed, dataset, epoch))
        return self._perms[key]

    def batch(self, positions: np.ndarray, seed: int | None) -> Batch:
        datasets, indices = self.locate(positions, seed)
        T = self.seq_len
        tokens = np.empty((len(positions), T + 1), dtype=np.int64)
        docs = np.empty((len(positions), T), dtype=np.int64)
        for row, (d, i) in enumerate(zip(datasets.tolist(), indices.tolist(), strict=True)):
            stream = self.streams[d]
            tokens[row] = stream.read(i * T, T + 1)
            docs[row] = stream.document_ids(i * T, T) + self.doc_base[d]
        t = torch.from_numpy(tokens)
        # Contiguous copies: losses call .view(-1) on labels, which a strided slice refuses.
        return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.from_numpy(docs))  # (m, T) each


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


@dataclass(frozen=True)
class Cursor:
    """Where the global order stands before a step: what the loader's state records."""

    steps: int = 0
    """Optimizer steps consumed."""
    position: int = 0
    """Global samples consumed in the order of `seq_len`: the next step starts there."""
    tokens: int = 0
    """Tokens consumed, every step's G x its seq_len, over every length the run has used."""
    seq_len: int = 0
    """The length of the segment `position` counts in."""

    def start(self, seq_len: int) -> tuple[int, int]:
        """(seq_len, first position) of the next step at `seq_len`: where it is, or at a new
        length the first window of that order at or past the tokens consumed."""
        if seq_len == self.seq_len:
            return seq_len, self.position
        return seq_len, -(-self.tokens // seq_len)  # ceil: no token seen twice in the stream's order

    def after(self, seq_len: int, global_batch_size: int) -> Cursor:
        """The cursor once a step of global_batch_size sequences of seq_len is consumed."""
        _, start = self.start(seq_len)
        return Cursor(steps=self.steps + 1, position=start + global_batch_size,
                      tokens=self.tokens + global_batch_size * seq_len, seq_len=seq_len)


class DataLoader:
    """Micro-batches for one data-parallel rank, one optimizer step at a time.

    `next_step()` returns the list of `accumulation_steps` micro-batches of the next step;
    iterating the loader yields the same lists forever. Batches are built by a background
    thread `prefetch` steps ahead; `data_wait_s` is the time the caller spent blocked.
    `seq_len_at(steps)`, when given, is the sequence length of the step after `steps` steps
    (train.seq_len_schedule); else every step has `seq_len`.
    """

    def __init__(self, data: DataArg, *, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0, split: str = "train",
                 prefetch: int = 2, tokenizer: Any = None, pin_memory: bool = False,
                 seq_len_at: Callable[[int], int] | None = None):
        if not 0 <= dp_rank < dp_world_size:
            raise ForjaError(f"data-parallel rank {dp_rank} is outside world size {dp_world_size}")
        self.accumulation_steps = check_batch_sizes(global_batch_size, micro_batch_size, dp_world_size)
        self.mixture = as_mixture(data, tokenizer)
        self.seq_len_at = seq_len_at or (lambda steps: seq_len)
        self.seq_len, self.split, self.seed = seq_len, split, seed
        self._samples: dict[int, Samples] = {}  # seq_len -> its windows, made when first used
        self.samples = self._samples_of(seq_len)  # the run's length: a split too short for it stops here
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.prefetch, self.pin_memory = max(0, prefetch), pin_memory
        self.cursor = Cursor(seq_len=self.seq_len_at(0))
        """The global order consumed by completed steps (what the state records)."""
        self._before: Cursor | None = None  # the cursor before the last next_step, for rewind_step
        self.data_wait_s = 0.0
        """Seconds `next_step` spent waiting for data, cumulative."""
        self._prefetcher: _Prefetcher | None = None

    def _samples_of(self, seq_len: int) -> Samples:
        if seq_len not in self._samples:
            self._samples[seq_len] = Samples(self.mixture, self.split, seq_len)
        return self._samples[seq_len]

    @property
    def position(self) -> int:
        """Global samples consumed in the order of the current length."""
        return self.cursor.position

    @property
    def tokens(self) -> int:
        """Tokens of the global order consumed by completed steps."""
        return self.cursor.tokens

    @property
    def samples_per_epoch(self) -> int:
        return self.samples.samples_per_epoch

    def next_seq_len(self) -> int:
        """The sequence length of the next step."""
        return self.seq_len_at(self.cursor.steps)

    def build_step(self, cursor: Cursor) -> list[Batch]:
        """This rank's micro-batches of the global batch of the step after `cursor`."""
        seq_len, start = cursor.start(self.seq_len_at(cursor.steps))
        samples = self._samples_of(seq_len)
        per_rank = self.global_batch_size // self.dp_world_size
        first = start + self.dp_rank * per_rank
        m = self.micro_batch_size
        steps = []
        for j in range(self.accumulation_steps):
            batch = samples.batch(np.arange(first + j * m, first + (j + 1) * m), self.seed)
            if self.pin_memory and torch.cuda.is_available():
                batch = Batch(*(t.pin_memory() for t in (batch.input_ids, batch.labels, batch.document_ids)))
            steps.append(batch)
        return steps

    def _advance(self, cursor: Cursor) -> Cursor:
        return cursor.after(self.seq_len_at(cursor.steps), self.global_batch_size)

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step (a list of accumulation_steps)."""
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

    def state_dict(self) -> dict[str, Any]:
        """The global cursor, and what a resume must match."""
        c = self.cursor
        return {"position": c.position, "steps": c.steps, "tokens": c.tokens, "seq_len": c.seq_len,
                "seed": self.seed, "split": self.split, "data_fingerprint": self.mixture.fingerprint,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved cursor; any data-parallel world size works, and any sequence
        length: a new one continues from the tokens consumed (the module's docstring). A state
        saved before the cursor held steps and tokens had one length all along."""
        for key, mine in (("seed", self.seed), ("split", self.split),
                          ("data_fingerprint", self.mixture.fingerprint)):
            if state.get(key) != mine:
                raise ForjaError(f"the checkpoint's data loader state has {key} {state.get(key)!r} but this run "
                                 f"has {mine!r}; resume with the same data settings or start a new run")
        position, seq_len = int(state["position"]), int(state["seq_len"])
        steps = int(state.get("steps", position // int(state.get("global_batch_size", self.global_batch_size))))
        self.close()
        self.cursor = Cursor(steps=steps, position=position, tokens=int(state.get("tokens", position * seq_len)),
                             seq_len=seq_len)
        self._before = None

    def close(self) -> None:
        """Stop the prefetch thread (it restarts at the current position when needed)."""
        prefetcher = getattr(self, "_prefetcher", None)  # None too if __init__ failed early
        if prefetcher is not None:
            prefetcher.stop()
            self._prefetcher = None

    def __del__(self) -> None:
        self.close()


class _Prefetcher:
    """A thread building steps ahead into a bounded queue, in order."""

    def __init__(self, build: Any, advance: Any, start: Cursor, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build, advance, start), daemon=True,
                                        name="forja-data-prefetch")
        self._thread.start()

    def _run(self, build: Any, advance: Any, cursor: Cursor) -> None:
        while not self._stop.is_set():
            try:
                item: Any = (cursor, build(cursor))
            except BaseException as exc:  # handed to the consumer, which raises it
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            cursor = advance(cursor)

    def get(self) -> tuple[Cursor, list[Batch]]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class ValidationLoader:
    """A fixed number of unshuffled micro-batches of a split, sharded by rank; no state.

    Batch b on rank r holds global positions [(b*w + r)*m, (b*w + r + 1)*m) in the split's
    natural order (positions past the end wrap around), so every pass sees the same samples.
    """

    def __init__(self, data: DataArg, *, seq_len: int, micro_batch_size: int, num_batches: int,
                 dp_rank: int = 0, dp_world_size: int = 1, split: str = "val", tokenizer: Any = None):
        if num_batches < 1 or micro_batch_size < 1:
            raise ForjaError(f"validation needs num_batches ({num_batches}) and micro_batch_size "
                             f"({micro_batch_size}) of at least 1")
        if not 0 <= dp_rank < dp_world_size:
            raise ForjaError(f"data-parallel rank {dp_rank} is outside world size {dp_world_size}")
        self.samples = Samples(as_mixture(data, tokenizer), split, seq_len)
        self.micro_batch_size, self.num_batches = micro_batch_size, num_batches
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        m = self.micro_batch_size
        for b in range(self.num_batches):
            first = (b * self.dp_world_size + self.dp_rank) * m
            yield self.samples.batch(np.arange(first, first + m), seed=None)
