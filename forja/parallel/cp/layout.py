"""Which tokens of each row every rank of a context-parallel group holds.

A row of T tokens is cut into equal chunks. Under "all-to-all" rank r holds chunk r of cp
(whole rows are put back together, in order, over a subset of heads). Under "ring" it holds
two of 2 cp chunks, r and its mirror 2 cp - 1 - r: with causal attention the first chunks see
few keys and the last many, so a chunk and its mirror cost every rank the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    kind: str
    """"ring" or "all-to-all" (ParallelConfig.cp_kind)."""
    cp: int
    """Ranks sharing each row."""
    rank: int
    """This rank's place among them."""
    seq_len: int
    """T, the row's length."""

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.kind == "ring" else self.cp

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.seq_len // self.n_chunks

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks (their places in the row) `rank` holds, in the order it holds them."""
        if self.kind == "ring":
            return (rank, self.n_chunks - 1 - rank)
        return (rank,)

    @property
    def my_chunks(self) -> tuple[int, ...]:
        return self.chunks_of(self.rank)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(T / cp,) the places in the row of this rank's tokens, in its order."""
        c = self.chunk
        return torch.cat([torch.arange(a * c, (a + 1) * c, device=device) for a in self.my_chunks])

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `x`, whose dimension `dim` is the row (T long)."""
        c = self.chunk
        return torch.cat([x.narrow(dim, a * c, c) for a in self.my_chunks], dim=dim)
