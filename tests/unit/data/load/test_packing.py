"""data.packing: windows, samples from document starts, best-fit with padding; each
deterministic, resumable at any position, with its padding and cut documents counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from forja.data import DataLoader, open_prepared
from forja.data.load.packing import IGNORE, PAD_DOCUMENT, BestFitPacking, BosPacking, _best_fit_decreasing

T, G, M = 32, 8, 2


@pytest.fixture(scope="module")
def ds(prepared_dir: Path):
    return open_prepared(prepared_dir)


def loader(ds, packing: str, world: int = 1, rank: int = 0, **kwargs) -> DataLoader:
    return DataLoader(ds, seq_len=T, global_batch_size=G, micro_batch_size=M, dp_rank=rank, dp_world_size=world,
                      packing=packing, **{"prefetch": 0, **kwargs})


def rows(ranks: list[DataLoader], steps: int) -> list[torch.Tensor]:
    """Per step, (G, T + 1): every rank's inputs with the last label, and the document ids."""
    out = []
    for _ in range(steps):
        parts = [torch.cat([b.input_ids, b.labels[:, -1:], b.document_ids], dim=1)
                 for r in ranks for b in r.next_step()]
        out.append(torch.cat(parts))
    return out


def test_bos_samples_start_at_document_starts_and_never_overlap(ds) -> None:
    stream = ds.split("train")
    bounds = stream.document_bounds()
    packed = BosPacking(stream, T, piece=T + 1)  # built in memory (no cache)
    long_docs = np.diff(bounds) > T + 1  # their pieces start inside them
    piece_starts = set(bounds[:-1].tolist())
    for start, length in zip(bounds[:-1][long_docs].tolist(), np.diff(bounds)[long_docs].tolist(), strict=True):
        piece_starts |= set(range(start, start + length, T + 1))
    assert set(packed.starts.tolist()) <= piece_starts
    assert (np.diff(packed.starts) >= T).all()  # a sample's last token is at most the next one's first
    got = packed.rows(np.arange(packed.count))
    at_document = np.isin(packed.starts, bounds[:-1])
    assert at_document.any() and (got.cut[at_document] <= 1).all()  # only the last document is cut
    assert got.cut.sum() > 0


def test_best_fit_places_whole_documents_and_pads(ds) -> None:
    stream = ds.split("train")
    bounds = stream.document_bounds()
    packed = BestFitPacking(stream, T, piece=T + 1, buffer=64, pad_id=2)
    got = packed.rows(np.arange(packed.count))
    # Every piece appears exactly once over the epoch, whole, and equals the stream's tokens there.
    seen = np.concatenate([packed.order[packed.ptr[k]:packed.ptr[k + 1]] for k in range(packed.count)])
    assert sorted(seen.tolist()) == list(range(len(packed.piece_start)))
    k = int(np.argmax(packed.padding(np.arange(packed.count))))
    pad = got.docs[k] == PAD_DOCUMENT
    assert pad.any() and (got.tokens[k][pad] == 2).all()
    assert pad[np.argmax(pad):].all()  # padding only at the end
    _, starts, lengths = packed.pieces_of(k)
    start, length = int(starts[0]), int(lengths[0])
    assert np.array_equal(got.tokens[k][:length], stream.read(start, length))
    short = np.diff(bounds) <= T + 1
    assert short.sum() > len(bounds) // 2  # the corpus is mostly short documents: few are cut
    assert got.cut.sum() == packed.piece_cut.sum()  # pieces of long documents are the only cuts
    assert (packed.padding(np.arange(packed.count)) == (got.docs == PAD_DOCUMENT).sum(axis=1)).all()


def test_best_fit_decreasing_fits_tightest_and_is_deterministic() -> None:
    lengths = np.array([5, 7, 3, 2, 6, 1, 4])
    bins = _best_fit_decreasing(lengths, capacity=10)
    assert [lengths[b].tolist() for b in bins] == [[7, 3], [6, 4], [5, 2, 1]]
    assert all(np.array_equal(a, b) for a, b in zip(bins, _best_fit_decreasing(lengths, 10), strict=True))


@pytest.mark.parametrize("packing", ["bos", "best-fit"])
def test_each_packing_shards_and_resumes_exactly(ds, packing: str) -> None:
    uninterrupted = rows([loader(ds, packing)], 8)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, rows([loader(ds, packing, 2, r) for r in range(2)], 8),
                                                 strict=True))
    before = loader(ds, packing, prefetch=2)
    rows([before], 3)
    after = [loader(ds, packing, 4, r) for r in range(4)]  # another world size
    for r in after:
        r.load_state_dict(before.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[3:], rows(after, 5), strict=True))


def test_best_fit_labels_ignore_padding_and_documents_stay_apart(ds) -> None:
    run = loader(ds, "best-fit", max_doc_tokens=20)
    batches = [b for _ in range(4) for b in run.next_step()]
    for b in batches:
        pad = b.document_ids == PAD_DOCUMENT
        assert (b.labels[pad] == IGNORE).all()
        # A label is ignored exactly where the token it names is padding.
        nxt = torch.cat([b.document_ids[:, 1:], torch.full_like(b.document_ids[:, :1], PAD_DOCUMENT)], 1)
        assert torch.equal(b.labels[:, :-1] == IGNORE, nxt[:, :-1] == PAD_DOCUMENT)
        real = b.document_ids[~pad]
        assert ((real >> 40) == 0).all()  # one source: its number 0 in the high bits
    step = run.next_step()
    labels = sum(int((b.labels != IGNORE).sum()) for b in step)
    assert step[0].step_labels == labels  # one process: the step's labels are this rank's
    metrics = run.step_metrics(step)
    assert 0 < metrics["data/padding"] < 1 and 0 <= metrics["data/cut_docs"] < 1
    assert metrics["data/padding"] == pytest.approx(1 - labels / (G * T))


def test_window_is_unchanged_and_counts_its_cut_documents(ds) -> None:
    run = loader(ds, "window")
    (first, *_) = run.next_step()
    assert torch.equal(first.labels[:, :-1], first.input_ids[:, 1:])  # no padding, no ignored label
    assert first.step_labels == G * T and first.cut_documents > 0


def test_indexes_are_kept_on_disk_and_memory_mapped(ds, tmp_path) -> None:
    stream = ds.split("train")
    built = BestFitPacking(stream, T, T + 1, 64, 2, cache=tmp_path)
    (folder,) = tmp_path.iterdir()
    assert (folder / "done").is_file() and not list(tmp_path.glob(".*"))  # no temporary copy left
    again = BestFitPacking(stream, T, T + 1, 64, 2, cache=tmp_path)
    assert isinstance(again.order, np.memmap) and again.count == built.count
    everything = np.arange(built.count)
    assert np.array_equal(again.rows(everything).tokens, built.rows(everything).tokens)
    BestFitPacking(stream, T, T + 1, 32, 2, cache=tmp_path)  # other options: another index
    BosPacking(stream, T, T + 1, cache=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
