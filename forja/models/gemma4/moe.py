"""Gemma 4's mixture of experts (the 26B-A4B's `enable_moe_block`): forja's MoE
(forja/models/common/moe.py) with Gemma 4's router and an input norm of the experts' own.

It sits beside the block's dense GeGLU, not instead of it (forja/models/gemma4/attention.py,
where it is the block's feed_forward and the GeGLU its `mlp`): both read the residual stream h
after attention, and

    dense   = post_mlp_norm(mlp(ffn_norm(h)))
    experts = post_moe_norm(sum_k w_k expert_k(expert_norm(h)))
    h       = h + post_ffn_norm(dense + experts)

The router scores the raw h, not a norm of it the block made: weightless RMS normalization,
times a learned per-channel `scale` (stored as `router.norm`'s weight) and dim^-1/2, then the
gate; a softmax over all experts in fp32, the top k, renormalized to sum to one, and only
then each chosen weight multiplied by its expert's learned `per_expert_scale` (so the weights
need not sum to one). The experts are GeGLUs (gelu_tanh(gate) * up), without shared experts.
"""

from __future__ import annotations

import torch
from torch import nn

from forja.models.common.moe import MoE, MoEArgs, Router, Routing
from forja.models.common.norms import RMSNorm


class Gemma4Router(Router):
    """Router scores of the raw residual stream: gate(rms_normalized(x) * scale * dim^-1/2),
    softmax and top-k as forja's router, then the chosen weights times `per_expert_scale`."""

    def __init__(self, dim: int, args: MoEArgs, eps: float):
        super().__init__(dim, args)
        self.norm = RMSNorm(dim, eps)  # its weight: transformers' router.scale
        self.per_expert_scale = nn.Parameter(torch.empty(args.n_experts))
        self.root = dim**-0.5

    def forward(self, x: torch.Tensor) -> Routing:
        """x (N, D) -> Routing, each chosen weight scaled by its expert's per_expert_scale."""
        route = super().forward(self.norm(x) * self.root)
        route.weights = route.weights * self.per_expert_scale[route.experts]  # (N, k)
        return route


class Gemma4MoE(MoE):
    """forja's MoE whose router reads the raw input and whose experts read `expert_norm` of
    it (transformers' pre_feedforward_layernorm_2): (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, args: MoEArgs, eps: float):
        super().__init__(dim, args)
        self.router = Gemma4Router(dim, args, eps)
        self.expert_norm = RMSNorm(dim, eps)

    def to_expert_width(self, flat: torch.Tensor) -> torch.Tensor:
        """The experts' input rows (N, D): a norm of the layer's input of their own, taken once a
        token here, not inside the experts, whose module expert parallelism and int8
        quantization move or replace."""
        return self.expert_norm(flat)
