"""The loader: seed-determined order, exact rank sharding, resume across world sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from forja.data import Batch, DataLoader, ValidationLoader, open_prepared
from forja.data.corpus.mixture import Mixture
from forja.errors import ForjaError

T, G, M = 16, 8, 2


def loaders(data, world: int, **kwargs) -> list[DataLoader]:
    kwargs = {"seq_len": T, "global_batch_size": G, "micro_batch_size": M, "seed": 0, **kwargs}
    return [DataLoader(data, dp_rank=r, dp_world_size=world, **kwargs) for r in range(world)]


def global_batches(ranks: list[DataLoader], steps: int) -> list[torch.Tensor]:
    """Per step, every rank's micro-batches in rank order, stacked: (G, T+1) tokens."""
    out = []
    for _ in range(steps):
        rows = [torch.cat([b.input_ids, b.labels[:, -1:]], dim=1) for r in ranks for b in r.next_step()]
        out.append(torch.cat(rows))
    return out


@pytest.fixture(scope="module")
def ds(prepared_dir: Path):
    return open_prepared(prepared_dir)


def test_batches_have_the_documented_shapes(ds) -> None:
    (loader,) = loaders(ds, 1)
    steps = loader.next_step()
    assert loader.accumulation_steps == G // M == len(steps)
    for b in steps:
        assert isinstance(b, Batch)
        for t in (b.input_ids, b.labels, b.document_ids):
            assert t.shape == (M, T) and t.dtype == torch.int64 and t.is_contiguous()
        assert torch.equal(b.labels[:, :-1], b.input_ids[:, 1:])


def test_same_seed_same_batches_different_seed_different(ds) -> None:
    a = global_batches(loaders(ds, 1, seed=3), 5)
    b = global_batches(loaders(ds, 1, seed=3, prefetch=0), 5)
    c = global_batches(loaders(ds, 1, seed=4), 5)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_together_see_exactly_the_single_process_batch(ds, world: int) -> None:
    single = global_batches(loaders(ds, 1), 6)
    sharded = global_batches(loaders(ds, world), 6)
    assert all(torch.equal(x, y) for x, y in zip(single, sharded, strict=True))


def test_an_epoch_has_every_sample_once_and_epochs_are_reshuffled(ds) -> None:
    (loader,) = loaders(ds, 1)
    n = loader.samples_per_epoch
    stream = ds.split("train")
    positions = np.arange(2 * n)
    _, index = loader.samples.locate(positions, seed=0)
    first, second = index[:n], index[n:]
    assert sorted(first.tolist()) == list(range(n)) and sorted(second.tolist()) == list(range(n))
    assert not np.array_equal(first, second)
    rows = torch.cat([torch.cat([b.input_ids, b.labels[:, -1:]], 1) for _ in range(3) for b in loader.next_step()])
    for row, i in zip(rows, index[: len(rows)], strict=True):
        assert row.tolist() == stream.read(int(i) * T, T + 1).tolist()


def test_ranks_neither_overlap_nor_leave_gaps(ds) -> None:
    world, steps = 4, 5
    seen = []
    for loader in loaders(ds, world):
        first = loader.dp_rank * (G // world)
        for s in range(steps):
            seen += range(s * G + first, s * G + first + G // world)
            loader.next_step()
    assert sorted(seen) == list(range(steps * G))


@pytest.mark.parametrize("new_world", [2, 1, 4])
def test_resume_at_step_k_equals_uninterrupted(ds, new_world: int) -> None:
    k, total = 3, 8
    uninterrupted = global_batches(loaders(ds, 2), total)
    before = loaders(ds, 2, prefetch=3)
    global_batches(before, k)
    states = [r.state_dict() for r in before]
    assert all(s == states[0] for s in states) and states[0]["position"] == k * G  # consumed, not prefetched
    after = loaders(ds, new_world)
    for r in after:
        r.load_state_dict(states[0])
    resumed = global_batches(after, total - k)
    assert all(torch.equal(x, y) for x, y in zip(uninterrupted[k:], resumed, strict=True))


def test_resume_goes_across_epochs(ds) -> None:
    (loader,) = loaders(ds, 1, global_batch_size=64, micro_batch_size=64)
    steps = loader.samples_per_epoch // 64 + 2
    run = global_batches([loader], steps)
    (skipped,) = loaders(ds, 1, global_batch_size=64, micro_batch_size=64)
    skipped.skip_steps(steps - 1)  # into the second epoch without building the first
    (again,) = loaders(ds, 1, global_batch_size=64, micro_batch_size=64)
    again.load_state_dict(skipped.state_dict())
    assert torch.equal(global_batches([again], 1)[0], run[-1])


def test_document_ids_match_the_boundaries(ds) -> None:
    eos = ds.eos_id
    lengths = [len(ds.document("train", i)) for i in range(ds.num_documents("train"))]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    (loader,) = loaders(ds, 1)
    _, index = loader.samples.locate(np.arange(2 * G), seed=0)
    batches = loader.next_step() + loader.next_step()
    docs = torch.cat([b.document_ids for b in batches])
    tokens = torch.cat([b.input_ids for b in batches])
    for row, i in enumerate(index.tolist()):
        expected = np.searchsorted(starts, np.arange(i * T, i * T + T), side="right") - 1
        assert docs[row].tolist() == expected.tolist()
        changes = (docs[row, 1:] != docs[row, :-1]).nonzero().flatten()
        assert all(tokens[row, c] == eos for c in changes.tolist())  # a document ends with eos


def test_sharded_data_gives_the_same_batches(ds, prepared_sharded_dir: Path) -> None:
    a = loaders(ds, 1)[0]
    b = loaders(open_prepared(prepared_sharded_dir), 1)[0]
    for _ in range(5):
        for x, y in zip(a.next_step(), b.next_step(), strict=True):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.document_ids, y.document_ids)


def test_divisibility_errors_name_the_config_keys(ds) -> None:
    with pytest.raises(ForjaError, match=r"train\.global_batch_size \(10\).*train\.micro_batch_size \(2\)"):
        DataLoader(ds, seq_len=T, global_batch_size=10, micro_batch_size=2, dp_world_size=4)
    with pytest.raises(ForjaError, match="rank 2 is outside world size 2"):
        DataLoader(ds, seq_len=T, global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_world_size=2)


def test_resume_refuses_other_settings(ds, other_dir: Path) -> None:
    (loader,) = loaders(ds, 1)
    state = loader.state_dict()
    (other,) = loaders(ds, 1, seed=5)
    with pytest.raises(ForjaError, match="seed 0 but this run has 5"):
        other.load_state_dict(state)
    (elsewhere,) = loaders(open_prepared(other_dir), 1)
    with pytest.raises(ForjaError, match=r"data.path \(stage 0\) differs in its data or weights"):
        elsewhere.load_state_dict(state)
    legacy = {k: state[k] for k in ("position", "seq_len", "seed", "split", "global_batch_size")}
    with pytest.raises(ForjaError, match="data_fingerprint"):  # a state from before data stages
        loader.load_state_dict({**legacy, "data_fingerprint": "elsewhere"})


def test_data_wait_is_reported(ds) -> None:
    (loader,) = loaders(ds, 1)
    assert loader.data_wait_s == 0.0
    loader.next_step()
    first = loader.data_wait_s
    loader.next_step()
    assert 0 < first <= loader.data_wait_s
    loader.close()


def test_too_little_data_for_seq_len(ds) -> None:
    with pytest.raises(ForjaError, match="too few for one sample"):
        DataLoader(ds, seq_len=10**7, global_batch_size=1, micro_batch_size=1)


def test_loader_opens_a_path_and_checks_the_tokenizer(prepared_dir: Path, tokenizer) -> None:
    from forja.data import train_tokenizer

    loader = DataLoader(str(prepared_dir), seq_len=T, global_batch_size=G, micro_batch_size=M, tokenizer=tokenizer)
    assert loader.next_step()[0].input_ids.shape == (M, T)
    with pytest.raises(ForjaError, match="tokens but"):
        DataLoader(prepared_dir, seq_len=T, global_batch_size=G, micro_batch_size=M,
                   tokenizer=train_tokenizer("stdlib:json", vocab_size=300))


def test_mixture_follows_weights_with_distinct_document_ids(ds, other_dir: Path) -> None:
    other = open_prepared(other_dir)
    (loader,) = loaders(Mixture.of([(ds, 3.0), (other, 1.0)]), 1, global_batch_size=40, micro_batch_size=40)
    dataset, _ = loader.samples.locate(np.arange(400), seed=0)
    assert np.bincount(dataset).tolist() == [300, 100]
    (batch,) = loader.next_step()
    from_other = torch.tensor(dataset[:40] == 1)
    assert (batch.document_ids[from_other] >= 1 << 40).all()  # the source's number in the high bits
    assert (batch.document_ids[~from_other] < ds.num_documents("train")).all()
    assert loader.state_dict()["data_fingerprint"] != loaders(ds, 1)[0].state_dict()["data_fingerprint"]


def test_validation_loader_is_fixed_and_rank_sharded(ds) -> None:
    stream = ds.split("val")
    n = (stream.num_tokens - 1) // T

    def rows(world: int, batches: int) -> torch.Tensor:
        """All ranks' batches, batch by batch and rank by rank: positions 0, 1, 2, ... in order."""
        per_rank = [list(ValidationLoader(ds, seq_len=T, micro_batch_size=M, num_batches=batches, dp_rank=r,
                                          dp_world_size=world)) for r in range(world)]
        return torch.cat([per_rank[r][b].input_ids for b in range(batches) for r in range(world)])

    def expected(count: int) -> torch.Tensor:  # the split's own order, wrapping past its end
        return torch.tensor(np.stack([stream.read((i % n) * T, T).astype(np.int64) for i in range(count)]))

    assert torch.equal(rows(1, 3), expected(3 * M))
    assert torch.equal(rows(1, 3), rows(1, 3))  # every pass is the same
    assert torch.equal(rows(2, 3), expected(6 * M))
    assert torch.equal(rows(4, 3), expected(12 * M))
    wraps = n // M + 2
    assert torch.equal(rows(1, wraps), expected(wraps * M))
    assert len(ValidationLoader(ds, seq_len=T, micro_batch_size=M, num_batches=3)) == 3
