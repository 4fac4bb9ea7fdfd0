"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

LayerNorm pre-norm blocks with biases, learned absolute positions, multi-head
attention, a GELU (tanh) MLP of width 4 * dim, and the output projection tied to the
token embedding. Module names match Llama's (attention.wq/wk/wv/wo, feed_forward.w1/w2)
so one tensor-parallel plan shape fits both; `hf.py` maps them to Hugging Face names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from forja.models.common.attention import Attention
from forja.models.common.blocks import TransformerBlock
from forja.models.common.mlp import GeluMLP
from forja.models.common.norms import LayerNorm
from forja.models.common.transformer import Transformer, TransformerArgs


@dataclass(kw_only=True)
class GPT2Args(TransformerArgs):
    """A GPT-2 model's shape; the package's FLAVORS hold the published sizes."""

    max_seq_len: int = 1024
    """Rows of the learned position embedding (n_positions)."""
    learned_positions: ClassVar[bool] = True
    tie_embeddings: bool = True
    """GPT-2 shares the token embedding with the output projection."""
    bias: bool = True
    """Biases in the attention and MLP projections."""


class GPT2(Transformer):
    args: GPT2Args

    def __init__(self, args: GPT2Args):
        super().__init__(args)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)

    def build_block(self, layer: int) -> TransformerBlock:
        a = self.args
        attention = Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, bias=a.bias, qk_norm=a.qk_norm,
                              norm_eps=a.norm_eps)
        return TransformerBlock(attention, GeluMLP(a.dim, a.ffn_dim, bias=a.bias),
                                LayerNorm(a.dim, a.norm_eps), LayerNorm(a.dim, a.norm_eps))

    def build_norm(self) -> LayerNorm:
        return LayerNorm(self.args.dim, self.args.norm_eps)

    def add_positions(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return h + self.pos_embeddings(positions)  # (B, T, dim) + (T, dim)

    def lookup_tables(self) -> list[nn.Parameter]:
        return super().lookup_tables() + [self.pos_embeddings.weight]

    def init_rule(self, name: str) -> tuple:
        """GPT-2's scheme: N(0, 0.02), residual projections scaled by 1/sqrt(2 L)."""
        if name.endswith("norm.weight"):
            return ("ones",)
        if name.endswith("bias"):
            return ("zeros",)
        if name == "pos_embeddings.weight":
            return ("normal", 0.01)
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return ("normal", 0.02 / math.sqrt(2 * self.args.n_layers))
        return ("normal", 0.02)
