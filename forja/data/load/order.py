"""The global order of samples: a function of the seed alone.

Two pieces, both computed on demand for any position, so no per-epoch array of sample ids is
ever stored (a trillion-token corpus has hundreds of millions of samples):

- `Permutation(n, key)`: a pseudo-random bijection of [0, n), a Feistel network on the next
  power of four with cycle walking (Black & Rogaway 2002, "Ciphers with arbitrary finite
  domains"). Each epoch of each dataset uses its own key, so epochs are reshuffled.
- `Interleave(weights)`: which dataset of a mixture global position p draws from, and which of
  that dataset's own positions it is. The pattern repeats every `period` positions and spreads
  each dataset evenly inside it (smooth weighted round robin), so any window of samples is close
  to the weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from forja.errors import ForjaError

_ROUNDS = 6
_MASK64 = (1 << 64) - 1
# Weights are resolved to integer shares of this many positions (then reduced by their gcd).
_RESOLUTION = 10_000


def derive_key(*parts: object) -> int:
    """A 64-bit key from any values (seed, dataset, epoch), stable across runs and machines."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-mixed 64-bit hash (Steele et al. 2014)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A keyed pseudo-random bijection of [0, n), evaluated on arrays of indices."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        self.n = n
        self._half = max(1, math.ceil(math.log2(n) / 2))  # bits per Feistel half
        self._mask = np.uint64((1 << self._half) - 1)
        keys, state = [], key & _MASK64
        for _ in range(_ROUNDS):
            state = (state + 0x9E3779B97F4A7C15) & _MASK64
            keys.append(np.uint64(state))
        self._keys = keys

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << half) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index, dtype=np.uint64)
        if index.size and int(index.max()) >= self.n:
            raise IndexError(f"index out of range [0, {self.n})")
        with np.errstate(over="ignore"):
            out = self._feistel(index)
            # Cycle walking: the Feistel domain is < 4n, so a few more rounds bring every
            # value back into [0, n), and the result is still a bijection of [0, n).
            outside = out >= np.uint64(self.n)
            while outside.any():
                out[outside] = self._feistel(out[outside])
                outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class Interleave:
    """Deterministic interleaving of datasets by weight."""

    def __init__(self, weights: Sequence[float]):
        if not weights or any(not w > 0 for w in weights):
            raise ForjaError(f"mixture weights {list(weights)} must be positive numbers")
        self.counts = _integer_shares(weights)
        self.period = int(sum(self.counts))
        pattern, rank = _smooth_round_robin(self.counts)
        self._pattern = pattern  # (period,) dataset of each position in the period
        self._rank = rank  # (period,) how many earlier positions of the period chose that dataset

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global positions -> (dataset index, position within that dataset's own stream)."""
        positions = np.asarray(positions, dtype=np.int64)
        block, offset = np.divmod(positions, self.period)
        dataset = self._pattern[offset]
        return dataset, block * self.counts[dataset] + self._rank[offset]


    def count(self, n: int) -> np.ndarray:
        """How many of the global positions [0, n) each dataset draws: (datasets,) int64."""
        block, offset = divmod(int(n), self.period)
        within = np.bincount(self._pattern[:offset], minlength=len(self.counts))
        return block * self.counts + within


def _integer_shares(weights: Sequence[float]) -> np.ndarray:
    """Largest-remainder integer shares of _RESOLUTION, reduced by their gcd."""
    total = float(sum(weights))
    exact = [w / total * _RESOLUTION for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: _RESOLUTION - sum(shares)]:
        shares[i] += 1
    if min(shares) == 0:
        raise ForjaError(f"mixture weights {list(weights)}: a weight below 1/{_RESOLUTION} of the total "
                         f"would never be sampled; raise it or drop that source")
    g = math.gcd(*shares)
    return np.array([s // g for s in shares], dtype=np.int64)


def _smooth_round_robin(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spread counts[d] picks of each dataset d evenly over one period (nginx's algorithm)."""
    period = int(counts.sum())
    current = np.zeros(len(counts), dtype=np.int64)
    pattern = np.empty(period, dtype=np.int64)
    rank = np.empty(period, dtype=np.int64)
    seen = np.zeros(len(counts), dtype=np.int64)
    for i in range(period):
        current += counts
        d = int(np.argmax(current))  # ties go to the lowest index: deterministic
        current[d] -= period
        pattern[i], rank[i] = d, seen[d]
        seen[d] += 1
    return pattern, rank
