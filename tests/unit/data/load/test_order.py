"""Sample order: keyed permutations are bijections; mixtures follow their weights exactly."""

from __future__ import annotations

import numpy as np
import pytest

from forja.data.load.order import Interleave, Permutation, derive_key
from forja.errors import ForjaError


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 123_457])
def test_permutation_is_a_bijection(n: int) -> None:
    out = Permutation(n, key=7)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_permutation_depends_on_key_and_shuffles() -> None:
    n = 10_000
    a, b = Permutation(n, 1)(np.arange(n)), Permutation(n, 2)(np.arange(n))
    assert np.array_equal(a, Permutation(n, 1)(np.arange(n)))
    assert not np.array_equal(a, b)
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05  # no visible trace of the input order
    assert np.array_equal(Permutation(n, 1)(np.array([5, 9999])), a[[5, 9999]])  # any index, on its own
    with pytest.raises(IndexError):
        Permutation(n, 1)(np.array([n]))


def test_huge_domains_need_no_table() -> None:
    n = 10**12
    out = Permutation(n, derive_key("x", 0))(np.array([0, 1, n - 1]))
    assert len(set(out.tolist())) == 3 and (out < n).all()


def test_interleave_counts_match_weights_and_spread_evenly() -> None:
    mix = Interleave([0.7, 0.2, 0.1])
    assert mix.counts.tolist() == [7, 2, 1] and mix.period == 10
    dataset, local = mix.locate(np.arange(1000))
    assert np.bincount(dataset).tolist() == [700, 200, 100]
    for d in range(3):  # each dataset's own positions are 0, 1, 2, ... in order
        assert local[dataset == d].tolist() == list(range((dataset == d).sum()))
    first10 = dataset[:10].tolist()
    assert max(len(s) for s in "".join(map(str, first10)).split("0")) <= 1  # no run of minor parts


def test_interleave_rejects_bad_weights() -> None:
    with pytest.raises(ForjaError, match="positive"):
        Interleave([1.0, 0.0])
    with pytest.raises(ForjaError, match="never be sampled"):
        Interleave([1.0, 1e-7])
