"""The loader at a changed sequence length: a resume at a longer train.seq_len continues from the
tokens consumed; train.seq_len_schedule's lengths step by step, resumable bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from forja.data import DataLoader, open_prepared
from forja.train.config import TrainConfig

G, M = 8, 2


@pytest.fixture(scope="module")
def ds(prepared_dir: Path):
    return open_prepared(prepared_dir)


def loader(ds, seq_len: int, world: int = 1, rank: int = 0, **kwargs) -> DataLoader:
    return DataLoader(ds, seq_len=seq_len, global_batch_size=G, micro_batch_size=M, seed=0,
                      dp_rank=rank, dp_world_size=world, **kwargs)


def rows(ranks: list[DataLoader], steps: int) -> list[torch.Tensor]:
    """Per step, the global batch's sequences with their last label, (G, T+1)."""
    out = []
    for _ in range(steps):
        out.append(torch.cat([torch.cat([b.input_ids, b.labels[:, -1:]], dim=1)
                              for r in ranks for b in r.next_step()]))
    return out


def test_a_longer_length_enters_its_order_at_the_tokens_consumed(ds):
    short = loader(ds, 16, prefetch=3)
    rows([short], 3)
    state = short.state_dict()
    assert state["tokens"] == 3 * G * 16 and state["steps"] == 3 and state["position"] == 3 * G
    long = loader(ds, 32)
    long.load_state_dict(state)
    first = rows([long], 1)[0]
    start = 3 * G * 16 // 32  # 12: the first 32-window starting at or after token 384 of the order
    expected = long.samples.batch(np.arange(start, start + G), seed=0)
    assert torch.equal(first[:, :-1], expected.input_ids)
    # In the stream's own order window p starts at token p * 32: the next token, none skipped or repeated.
    _, index = long.samples.locate(np.array([start]), seed=None)
    assert index[0] * 32 == 3 * G * 16
    assert long.tokens == 3 * G * 16 + G * 32 and long.cursor.steps == 4
    assert long.cursor.source(ds.fingerprint).position == start + G


def test_a_length_that_does_not_divide_rounds_up_to_a_whole_window(ds):
    short = loader(ds, 16)
    rows([short], 3)  # 384 tokens
    odd = loader(ds, 40)
    odd.load_state_dict(short.state_dict())
    assert odd.segment(odd.cursor).bases == (10,)  # window 10 starts at token 400: 16 tokens passed over, none twice


def test_resumed_at_a_new_length_any_world_size_sees_the_same(ds):
    before = loader(ds, 16)
    rows([before], 2)
    state = before.state_dict()
    single, pair = loader(ds, 64), [loader(ds, 64, 2, r) for r in range(2)]
    for r in [single, *pair]:
        r.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(rows([single], 3), rows(pair, 3), strict=True))


def test_a_checkpoint_saved_before_tokens_were_recorded_loads_through_dcp(ds, tmp_path):
    """DCP refuses a field the checkpoint lacks: the trainer loads the loader as a `partial` entry."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from forja.checkpoint.manager import loadable_state

    before = loader(ds, 16)
    rows([before], 3)
    old = {k: v for k, v in before.state_dict().items()
           if k in ("position", "seq_len", "seed", "split", "data_fingerprint", "global_batch_size")}  # the keys it had
    dcp.save({"dataloader": old}, checkpoint_id=str(tmp_path / "ck"))
    longer = loader(ds, 32)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: dataloader\\."):
        dcp.load({"dataloader": longer}, checkpoint_id=str(tmp_path / "ck"))
    dcp.load(loadable_state({"dataloader": longer}, tmp_path / "ck", partial=("dataloader",)),
             checkpoint_id=str(tmp_path / "ck"))
    assert (longer.cursor.steps, longer.tokens, longer.segment(longer.cursor).bases) == (3, 3 * G * 16, (12,))


def test_a_state_saved_before_tokens_were_recorded_resumes(ds):
    fresh = loader(ds, 16)
    old = {"position": 3 * G, "seed": 0, "seq_len": 16, "split": "train", "global_batch_size": G,
           "data_fingerprint": fresh.mixture.fingerprint}  # the keys of a state from before the cursor
    fresh.load_state_dict(old)
    assert (fresh.cursor.steps, fresh.tokens) == (3, 3 * G * 16)
    uninterrupted = loader(ds, 16)
    assert torch.equal(rows([fresh], 1)[0], rows([uninterrupted], 4)[3])


@pytest.mark.parametrize("kind", ["step", "linear"])
def test_scheduled_lengths_per_step(ds, kind):
    cfg = TrainConfig(steps=12, seq_len=64, seq_len_schedule=[[0, 16], [4, 32], [8, 64]], seq_len_schedule_kind=kind)
    run = loader(ds, 64, seq_len_at=cfg.seq_len_at)
    lengths = [b.shape[1] - 1 for b in rows([run], 12)]
    assert lengths == [cfg.seq_len_at(s) for s in range(12)]
    if kind == "step":
        assert lengths == [16] * 4 + [32] * 4 + [64] * 4
    else:  # multiples of gcd(16, 32, 64) = 16, from one entry's length towards the next
        assert lengths == [16, 16, 16, 16, 32, 32, 48, 48, 64, 64, 64, 64]
    assert run.tokens == G * sum(lengths)


@pytest.mark.parametrize("kind", ["step", "linear"])
@pytest.mark.parametrize("k", [3, 4, 5])  # before, at and after the boundary at step 4
def test_resume_across_a_schedule_boundary_is_bit_exact(ds, kind, k):
    cfg = TrainConfig(steps=10, seq_len=48, seq_len_schedule=[[0, 16], [4, 48]], seq_len_schedule_kind=kind)
    uninterrupted = rows([loader(ds, 48, seq_len_at=cfg.seq_len_at)], 10)
    before = loader(ds, 48, seq_len_at=cfg.seq_len_at, prefetch=3)  # the prefetcher crosses the boundary
    rows([before], k)
    after = [loader(ds, 48, 2, r, seq_len_at=cfg.seq_len_at) for r in range(2)]
    for r in after:
        r.load_state_dict(before.state_dict())
    resumed = rows(after, 10 - k)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[k:], resumed, strict=True))


def test_rewind_and_skip_follow_the_schedule(ds):
    cfg = TrainConfig(steps=10, seq_len=32, seq_len_schedule=[[0, 16], [2, 32]])
    ref = rows([loader(ds, 32, seq_len_at=cfg.seq_len_at)], 5)
    run = loader(ds, 32, seq_len_at=cfg.seq_len_at)
    rows([run], 2)
    run.next_step()
    run.rewind_step()  # the step at the boundary given back: returned again
    assert torch.equal(rows([run], 1)[0], ref[2])
    run.skip_steps(1)
    assert torch.equal(rows([run], 1)[0], ref[4])
