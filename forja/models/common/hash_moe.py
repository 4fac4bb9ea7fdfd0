"""DeepSeek-V4's mixture of experts (2026, section 2.1): `common/moe.py`'s layer with three changes.

- Scores sqrt(softplus(logits)) ("sqrtsoftplus"; softmax and sigmoid remain), the chosen
  experts' scores always renormalized to sum to 1, then times `route_scale`.
- Hash routing for the first layers ("hash_moe"): which experts a token goes to is a frozen
  table lookup tid2eid[token id] (vocab, top_k), not a top-k of the scores; the learned router
  still weighs the looked-up experts. The table is a checkpointed buffer, never trained.
- A limited SwiGLU in the routed and shared experts alike:
  silu(min(gate, limit)) * clamp(up, -limit, limit).

A hash layer needs the token ids: `forward(x, token_ids)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forja.errors import ForjaError
from forja.models.common.mlp import SwiGLU
from forja.models.common.moe import GroupedExperts, MoE, MoEArgs, Router, Routing

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


@dataclass(kw_only=True)
class ScoredMoEArgs(MoEArgs):
    """MoEArgs whose `score_func` may also be "sqrtsoftplus" and whose experts are limited SwiGLUs."""

    def check_moe(self) -> None:
        if self.n_experts <= 0:
            return
        if self.score_func not in SCORE_FUNCS:
            raise ForjaError(f"model score_func = {self.score_func!r} must be one of {', '.join(SCORE_FUNCS)}; "
                             "change it in model.overrides")
        saved = self.score_func, self.expert_activation
        self.score_func, self.expert_activation = "sigmoid", "swiglu"  # the rest checked as any MoE's
        try:
            MoEArgs.check_moe(self)
        finally:
            self.score_func, self.expert_activation = saved


def expert_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """(N, E) fp32 logits -> the experts' scores."""
    if score_func == "softmax":
        return logits.softmax(-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


class ScoredRouter(Router):
    """Top-k of (scores + expert_bias), or with `hashed` a lookup in `tid2eid` of the token ids
    set by the layer just before (`token_ids` (N,))."""

    def __init__(self, dim: int, args: MoEArgs, *, hashed: bool, vocab_size: int):
        super().__init__(dim, args)
        self.hashed = hashed
        self.token_ids: torch.Tensor | None = None
        if hashed:  # the table chooses: no balancing bias
            if self.expert_bias is not None:
                del self.expert_bias
                self.expert_bias = None
            self.register_buffer("tid2eid", torch.zeros(vocab_size, args.top_k, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> Routing:
        a = self.args
        logits = self.gate(x)  # (N, E) fp32
        scores = expert_scores(logits, a.score_func)
        if self.hashed:
            if self.token_ids is None:
                raise ForjaError("a hash-routed MoE layer needs the token ids; run it through its model's forward")
            experts = self.tid2eid[self.token_ids]  # (N, k)
        else:
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            experts = choice.topk(a.top_k, dim=-1, sorted=False).indices  # (N, k)
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * a.route_scale
        probs = scores if a.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(weights=weights, experts=experts, logits=logits, probs=probs)

    def init_buffers(self) -> None:
        super().init_buffers()
        if self.hashed:  # a checkpoint brings the real table; a fresh model spreads ids over experts
            with torch.no_grad():
                E, k = self.args.n_experts, self.args.top_k
                ids = torch.arange(self.tid2eid.shape[0], device=self.tid2eid.device)[:, None]
                self.tid2eid.copy_((ids * k + torch.arange(k, device=ids.device)[None, :]) % E)


def limited_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class LimitedExperts(GroupedExperts):
    """Grouped experts with the limited SwiGLU."""

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return limited_swiglu(gate, up, self.limit)


class LimitedSwiGLU(SwiGLU):
    """w2(limited_swiglu(w1 x, w3 x)): DeepSeek-V4's shared expert."""

    def __init__(self, dim: int, hidden_dim: int, limit: float):
        super().__init__(dim, hidden_dim)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(limited_swiglu(self.w1(x), self.w3(x), self.limit))


class ScoredMoE(MoE):
    """The MoE layer with `ScoredRouter` (hash-routed when `hashed`), limited-SwiGLU routed and
    shared experts: (B, T, D), token ids (B, T) -> (B, T, D)."""

    def __init__(self, dim: int, args: ScoredMoEArgs, *, hashed: bool, vocab_size: int):
        super().__init__(dim, args)
        self.router = ScoredRouter(dim, args, hashed=hashed, vocab_size=vocab_size)
        self.experts = LimitedExperts(args.n_experts, dim, args.moe_ffn_dim, args.moe_impl,
                                      activation="limited_swiglu", limit=args.swiglu_limit)
        self.shared_experts = LimitedSwiGLU(dim, args.shared_width, args.swiglu_limit) if args.shared_width else None

    def structure_fields(self) -> dict:
        return {**super().structure_fields(), "expert_activation": "limited_swiglu"}

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.router.token_ids = None if token_ids is None else token_ids.reshape(-1)
        try:
            return super().forward(x)
        finally:
            self.router.token_ids = None

