"""Data stages: a run's mixture changing at given steps, resumed exactly across the boundaries,
at any world size, with future stages editable and past ones guarded; per-source accounts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forja.data import DataLoader, open_prepared
from forja.data.load.stages import Stage
from forja.errors import ForjaError

T, G, M = 16, 8, 2


@pytest.fixture(scope="module")
def a(prepared_dir: Path):
    return open_prepared(prepared_dir)


@pytest.fixture(scope="module")
def b(other_dir: Path):
    return open_prepared(other_dir)


def three(a, b, *, weights=(1.0, 1.0), last_start: int = 7) -> list[Stage]:
    """Stage 1 mixes both sources from step 4, stage 2 is b alone at half the length."""
    return [Stage(4, [(a, weights[0]), (b, weights[1])]), Stage(last_start, b, seq_len=T // 2)]


def loader(a, stages, world: int = 1, rank: int = 0, **kwargs) -> DataLoader:
    return DataLoader(a, seq_len=T, global_batch_size=G, micro_batch_size=M, dp_rank=rank, dp_world_size=world,
                      stages=stages, **{"prefetch": 0, **kwargs})


def rows(ranks: list[DataLoader], steps: int) -> list[torch.Tensor]:
    """Per step, every rank's samples (G, T + 1) in rank order: inputs and the last label."""
    return [torch.cat([torch.cat([x.input_ids, x.labels[:, -1:]], 1) for r in ranks for x in r.next_step()])
            for _ in range(steps)]


def test_each_stage_draws_from_its_data_at_its_length(a, b) -> None:
    run = loader(a, three(a, b))
    lengths, stages = [], []
    for _ in range(9):
        batches = run.next_step()
        lengths.append(batches[0].input_ids.shape[1])
        stages.append(run.step_metrics(batches)["stage"])
    assert stages == [0, 0, 0, 1, 1, 1, 2, 2, 2] and lengths == [T] * 6 + [T // 2] * 3
    tokens = run.source_tokens()
    assert sum(tokens.values()) == run.tokens == G * (6 * T + 3 * T // 2)
    # b gives half of stage 1 (equal weights) and all of stage 2.
    assert list(tokens.values())[1] == G * 3 * T // 2 + G * 3 * T // 2


@pytest.mark.parametrize("k", [3, 4, 6, 7])  # before, at, inside and at the second boundary
def test_resume_across_a_stage_boundary_at_another_world_size_is_exact(a, b, k: int) -> None:
    uninterrupted = rows([loader(a, three(a, b))], 9)
    before = loader(a, three(a, b), prefetch=3)  # the prefetcher runs across the boundary
    rows([before], k)
    after = [loader(a, three(a, b), 2, r) for r in range(2)]
    for r in after:
        r.load_state_dict(before.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(uninterrupted[k:], rows(after, 9 - k), strict=True))


def test_future_stages_can_change_and_the_run_continues_exactly(a, b) -> None:
    before = loader(a, three(a, b))
    rows([before], 2)
    edited = three(a, b, weights=(1.0, 3.0), last_start=8) + [Stage(9, a)]  # reweighted, moved, one appended
    resumed = loader(a, edited)
    resumed.load_state_dict(before.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(rows([loader(a, edited)], 10)[2:], rows([resumed], 8), strict=True))


def test_a_begun_stage_cannot_change(a, b) -> None:
    before = loader(a, three(a, b))
    rows([before], 5)  # inside stage 1
    state = before.state_dict()
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(stage 1\) differs in its data or weights .* a stage "
                                         r"already begun cannot change: restore it, or change only stages that "
                                         r"start after step 5"):
        loader(a, three(a, b, weights=(2.0, 1.0))).load_state_dict(state)
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(stage 1\) starts at step 3, but this run is past "
                                         r"step 3 without it"):
        early = loader(a, [])
        rows([early], 3)
        loader(a, [Stage(3, b)]).load_state_dict(early.state_dict())
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(stage 1\) was trained on from step 4"):
        loader(a, []).load_state_dict(state)
    assert loader(a, three(a, b, last_start=9)).load_state_dict(state) is None  # a future stage moved: fine


def test_a_source_shared_by_two_stages_goes_on_where_it_was(a, b) -> None:
    """a's samples of stage 0 are not drawn again in stage 1 (within a's epoch)."""
    run = loader(a, [Stage(4, [(a, 1.0), (b, 1.0)])], seed=3)
    seen: list[tuple] = []
    for _ in range(8):
        for x in run.next_step():
            from_a = (x.document_ids >> 40)[:, 0] == 0
            seen += [tuple(r.tolist()) for r in torch.cat([x.input_ids, x.labels[:, -1:]], 1)[from_a]]
    assert len(seen) == 3 * G + 5 * G // 2 and len(set(seen)) == len(seen)


def test_stages_need_one_tokenizer_and_distinct_parts(a, b, tokenizer, tmp_path) -> None:
    with pytest.raises(ForjaError, match=r"data.stages\[0\] \(stage 1\) lists the same data twice"):
        loader(a, [Stage(4, [(b, 1.0), (b, 2.0)])])
    from forja.data import prepare, train_tokenizer

    other_tok = train_tokenizer("stdlib:json", vocab_size=300)
    odd = prepare("stdlib:json", other_tok, tmp_path / "odd", val_fraction=0.2, workers=1)
    with pytest.raises(ForjaError, match="one tokenizer serves every stage"):
        loader(a, [Stage(4, odd)])
