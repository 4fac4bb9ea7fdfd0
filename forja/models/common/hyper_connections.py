"""Manifold-constrained hyper-connections (mHC): a residual stream widened to `n` parallel
streams, mixed around each sublayer by weights computed from the streams themselves.

Xie et al. 2026, "mHC: Manifold-Constrained Hyper-Connections" (after Zhu et al. 2024,
"Hyper-Connections", arXiv 2409.19606); DeepSeek-V4 (2026) section 2.2. With streams
X (B, T, n, D), one sublayer f becomes

    a      = rms(flatten(X)) W^T                         (B, T, 2n + n^2), fp32
    pre    = sigmoid(s_pre a_pre + b_pre) + eps          (B, T, n)   collapse weights
    post   = 2 sigmoid(s_post a_post + b_post)           (B, T, n)   expand weights
    comb   = Sinkhorn(softmax(s_comb a_comb + b_comb))   (B, T, n, n) doubly stochastic
    X'     = post (x) f(sum_i pre_i X_i) + comb^T X

The Sinkhorn-Knopp projection (alternate column and row normalizations) keeps the residual
mixing close to a doubly-stochastic matrix, so the streams' norm cannot grow layer after
layer. `HyperHead` collapses the streams once more before the final norm (pre weights only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forja.models.common.attention import unit_rms


class HyperConnection(nn.Module):
    """The mHC weights of one sublayer, computed in fp32 from the `n` streams (B, T, n, D).

    `fn` (2n + n^2, n D) projects the normalized flattened streams to the pre, post and comb
    logits; `base` (2n + n^2,) their biases; `scale` (3,) one gain for each of the three."""

    def __init__(self, dim: int, n_streams: int, *, sinkhorn_iters: int = 20, eps: float = 1e-6,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.n, self.sinkhorn_iters, self.eps, self.norm_eps = n_streams, sinkhorn_iters, eps, norm_eps
        width = (2 + n_streams) * n_streams
        self.fn = nn.Parameter(torch.empty(width, n_streams * dim))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (B, T, n, D) -> (post (B, T, n) fp32, comb (B, T, n, n) fp32, the sublayer's
        input: the streams collapsed by pre, (B, T, D) in the streams' dtype)."""
        n = self.n
        flat = unit_rms(streams.flatten(2).float(), self.norm_eps)  # (B, T, n D)
        mixes = F.linear(flat, self.fn.float())  # (B, T, 2n + n^2)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps  # (B, T, n)
        post = 2 * torch.sigmoid(post_w * s_post + post_b)  # (B, T, n)
        comb_logits = comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n)  # (B, T, n, n)
        comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + self.eps, self.sinkhorn_iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)  # (B, T, D)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the sublayer: post (x) out + comb^T streams, (B, T, n, D).
        comb is read with its first index summed over (stream j feeds stream k with comb[j, k]):
        a Sinkhorn matrix is not symmetric, so the direction matters."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on positive matrices m (..., n, n): columns normalized first, then
    `iters - 1` rounds of rows then columns (each sum padded by eps)."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperHead(nn.Module):
    """The final collapse of the `n` streams (B, T, n, D) -> (B, T, D) before the output norm:
    sigmoid(scale * rms(flatten(X)) fn^T + base) + eps weighs each stream."""

    def __init__(self, dim: int, n_streams: int, *, eps: float = 1e-6, norm_eps: float = 1e-6):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n_streams, n_streams * dim))
        self.base = nn.Parameter(torch.empty(n_streams))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unit_rms(streams.flatten(2).float(), self.norm_eps)  # (B, T, n D)
        mixes = F.linear(flat, self.fn.float())  # (B, T, n)
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)  # (B, T, D)
