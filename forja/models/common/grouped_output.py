"""Grouped low-rank output projection (DeepSeek-V4, 2026, section 2.3.1 "Grouped Output
Projection").

With many wide heads the attention output H hd is far wider than the model (V4-Flash:
64 x 512 = 32768 against 4096), so projecting it straight down would dominate a token's
cost. The heads are cut into `groups` contiguous groups; each group's H hd / g channels go
through its own (H hd / g -> rank) matrix, and one dense (g rank -> dim) matrix mixes the
results:

    y = wo_b concat_g(wo_a[g] o_g)
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedLowRankOutput(nn.Module):
    """(B, T, H hd) -> (B, T, dim) through `groups` block-diagonal projections to `rank`
    each, then a dense one. `wo_a` stacks the groups' matrices as (groups * rank, H hd / groups)."""

    def __init__(self, in_dim: int, dim: int, groups: int, rank: int):
        super().__init__()
        self.groups, self.rank = groups, rank
        self.wo_a = nn.Parameter(torch.empty(groups * rank, in_dim // groups))
        self.wo_b = nn.Linear(groups * rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        g = self.wo_a.shape[0] // self.rank  # all groups; under tensor parallelism this rank's
        per_group = x.reshape(B * T, g, -1).transpose(0, 1)  # (g, B T, H hd / g)
        w = self.wo_a.view(g, self.rank, -1).transpose(1, 2)  # (g, H hd / g, rank)
        low = torch.bmm(per_group, w).transpose(0, 1)  # (B T, g, rank)
        return self.wo_b(low.reshape(B, T, g * self.rank))  # (B, T, dim)
