"""Distributed Muon's plan (forja/optim/exchange.py), without processes: owners balanced by
size, whole holders keep their matrices, sources and buckets, shards that do not tile."""

from __future__ import annotations

import pytest
import torch

from forja.optim.exchange import buckets, plan_units


def _boxes(per_rank: list[list[tuple[int, ...]]]) -> torch.Tensor:
    return torch.tensor(per_rank, dtype=torch.int64)  # (n, P, 6)


def test_owners_are_balanced_by_size_and_only_owners_receive_blocks():
    # Two ranks, FSDP row shards of a 64 x 8, a 32 x 8 and two 16 x 8 matrices.
    shapes = [(1, 64, 8), (1, 32, 8), (1, 16, 8), (1, 16, 8)]
    boxes = _boxes([[(0, 0, 0, 1, m // 2, 8) for _, m, _ in shapes],
                    [(0, m // 2, 0, 1, m // 2, 8) for _, m, _ in shapes]])
    units = plan_units(shapes, boxes)
    assert [u.owner for u in units] == [0, 1, 1, 1]  # 64 -> 0; then 32, 16, 16 -> 1 (loads 64 / 64)
    for u in units:
        other = 1 - u.owner
        assert u.sources == {other: u.blocks[other]}  # the owner lacks only the other rank's block
    assert [len(b) for b in buckets(units, bucket_numel=600)] == [1, 3]  # 512 | 256 + 128 + 128
    assert [len(b) for b in buckets(units, bucket_numel=10**6)] == [4]


def test_experts_held_whole_stay_with_their_holder_and_move_nothing():
    # Stacked (4, 8, 8) experts, two whole experts per rank (sharded over experts only).
    boxes = _boxes([[(0, 0, 0, 2, 8, 8)], [(2, 0, 0, 2, 8, 8)]])
    units = plan_units([(4, 8, 8)], boxes)
    assert [u.owner for u in units] == [0, 0, 1, 1]
    assert all(not u.sources for u in units) and buckets(units, 10**6) == []


def test_replicas_receive_the_result_and_the_lowest_holder_sends():
    # HSDP: ranks 0, 2 hold rows 0-3, ranks 1, 3 rows 4-7 of an 8 x 4 matrix.
    top, bottom = (0, 0, 0, 1, 4, 4), (0, 4, 0, 1, 4, 4)
    (u,) = plan_units([(1, 8, 4)], _boxes([[top], [bottom], [top], [bottom]]))
    assert u.owner == 0 and u.sources == {1: (4, 4, 0, 4)}
    assert len(buckets([u], 10**6)) == 1  # ranks 1-3 get their blocks of the result back


def test_shards_that_do_not_tile_the_matrix_are_refused():
    with pytest.raises(ValueError, match="do not tile"):
        plan_units([(1, 8, 4)], _boxes([[(0, 0, 0, 1, 4, 4)], [(0, 0, 0, 1, 4, 4)]]))
