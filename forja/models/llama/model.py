"""Llama 3 (Meta, "The Llama 3 Herd of Models", 2024), single-device.

RMSNorm pre-norm blocks, grouped-query attention with rotary positions (with the
Llama 3.1 long-context frequency scaling), SwiGLU feed-forward, untied or tied
(Llama 3.2 1B/3B) embeddings, optional QK-norm. Parameter names follow
the dense tensor-parallel plan's (common/tp_plan.py): attention.wq/wk/wv/wo, feed_forward.w1/w2/w3.

Five switches from the speedrun literature (Keller Jordan et al., modded-nanogpt, 2024-2025),
each off by default, each measured on its own in bench/RESULTS.md ("The best model per
second"): a squared-ReLU feed-forward (`ffn_activation = "relu2"`, So et al. 2021, "Primer"),
a tanh soft cap on the logits (`logit_softcap`), zero-initialized projections into the residual
stream and the output layer (`zero_init_projections`), U-net skip connections from the
first half's blocks to the second half's, each scaled by a learned weight (`unet_skips`), and
value embeddings: lookup tables of the tokens mixed into the values of the first and last
blocks (`value_embeddings`).
transformers' LlamaForCausalLM has none of them: such a model is read back by forja's own loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import KVCache
from forja.models.common.blocks import TransformerBlock
from forja.models.common.decoder import RESIDUAL_OUT, RotaryDecoder
from forja.models.common.mlp import SquaredReLUMLP
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.tp_plan import TPPlan, dense_tp_plan
from forja.models.common.transformer import TransformerArgs


@dataclass(kw_only=True)
class LlamaArgs(TransformerArgs):
    """A Llama model's shape; the package's FLAVORS hold the published sizes."""

    rope_theta: float = 500_000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | YarnScaling | None = None
    """Llama 3.1's frequency scaling or YaRN (model.rope_scaling, a table whose rope_type is "llama3",
    the default here, or "yarn"); None for plain RoPE."""
    ffn_activation: Literal["swiglu", "relu2"] = "swiglu"
    """The feed-forward: SwiGLU (w2(silu(w1 x) * w3 x)), or "relu2": w2(relu(w1 x)^2) with no
    gate (at ffn_dim x 1.5 it holds SwiGLU's parameters)."""
    logit_softcap: float | None = None
    """Logits become cap * tanh(logits / cap); None: not capped."""
    zero_init_projections: bool = False
    """attention.wo, feed_forward.w2 and an untied output layer start at zero (each block starts
    as the identity; the first steps' updates set them). A tied output is the embedding, kept."""
    unet_skips: bool = False
    """Block n_layers - 1 - i also receives the output of block i (i < n_layers // 2) times a
    learned scalar (`skip_weights`, starting at 1), added before it runs."""
    value_embeddings: int = 0
    """k tables (vocab_size x n_kv_heads * head_dim, `value_embeds`): block i < k and block
    n_layers - k + i mix table i's row of each token into their values (Attention's
    `value_embedding`); 0: none. At most n_layers // 2."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="llama3")
        super().__post_init__()
        if self.ffn_activation not in ("swiglu", "relu2"):
            raise ForjaError(f"model.ffn_activation={self.ffn_activation!r} is not one of 'swiglu', 'relu2'")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ForjaError(f"model.logit_softcap={self.logit_softcap} must be positive (or None: not capped)")
        if self.logit_softcap is not None and "cross_entropy" in self.fused_ops:
            raise ForjaError("model.logit_softcap is set, but the fused cross-entropy never forms the logits to "
                             "cap; drop cross_entropy from model.fused_ops")
        if self.unet_skips and self.n_layers < 2:
            raise ForjaError(f"model.unet_skips needs at least 2 layers (model.n_layers={self.n_layers})")
        if not 0 <= self.value_embeddings <= self.n_layers // 2:
            raise ForjaError(f"model.value_embeddings={self.value_embeddings} must be between 0 and n_layers // 2 "
                             f"= {self.n_layers // 2} (each table serves one early and one late block)")

    def value_table(self, layer: int) -> int | None:
        """The value embedding table block `layer` reads, or None."""
        k, n = self.value_embeddings, self.n_layers
        return layer if layer < k else layer - (n - k) if layer >= n - k else None

    def layout_limits(self) -> dict[str, str]:
        # The skips join blocks a pipeline puts on different stages, and their scalar weights
        # multiply hidden states that tensor parallelism holds as DTensors. Value embeddings
        # read the token ids, which a pipeline's later stages do not have, and are as wide
        # as the values tensor parallelism splits by heads.
        limits = {}
        for on, name in ((self.unet_skips, "U-net skips (model.unet_skips)"),
                         (self.value_embeddings, "value embeddings (model.value_embeddings)")):
            if on:
                limits.setdefault("tp", name)
                limits.setdefault("pp", name)
        return limits

    def hf_blockers(self) -> list[str]:
        """The switches transformers' LlamaForCausalLM has no equivalent of, by name."""
        on = {"qk_norm": self.qk_norm, "sliding_window": self.sliding_window is not None,
              "ffn_activation": self.ffn_activation != "swiglu", "logit_softcap": self.logit_softcap is not None,
              "unet_skips": self.unet_skips, "value_embeddings": self.value_embeddings > 0}
        return [name for name, set_ in on.items() if set_]


class Llama(RotaryDecoder):
    """RotaryDecoder as it stands: grouped-query attention, whole-head RoPE, SwiGLU; and the
    speedrun switches of LlamaArgs."""

    args: LlamaArgs

    def __init__(self, args: LlamaArgs):
        super().__init__(args)
        # One learned scale per skip, (n_layers // 2,), at the root: its blocks may not be split (layout_limits).
        self.skip_weights = nn.Parameter(torch.ones(args.n_layers // 2)) if args.unet_skips else None
        width = args.n_kv_heads * args.head_dim
        self.value_embeds = nn.ModuleList([nn.Embedding(args.vocab_size, width) for _ in range(args.value_embeddings)]
                                          ) if args.value_embeddings else None

    def build_attention(self, layer: int) -> nn.Module:
        return self.gqa_attention(value_embedding=self.args.value_table(layer) is not None)

    def build_block(self, layer: int) -> TransformerBlock:
        a = self.args
        mlp = self.build_feed_forward(layer) if a.ffn_activation == "swiglu" else SquaredReLUMLP(a.dim, a.ffn_dim)
        block = ValueBlock if a.value_embeddings else TransformerBlock
        return block(self.build_attention(layer), mlp, self.build_norm(), self.build_norm())

    def run_blocks(self, h: torch.Tensor, kinds: dict[str, str], ropes: dict, masks: dict,
                   cache: KVCache | None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if self.skip_weights is None and self.value_embeds is None:
            return super().run_blocks(h, kinds, ropes, masks, cache)
        n, half = self.args.n_layers, self.args.n_layers // 2
        # Each table's rows of the tokens (B, T, Hkv * hd), looked up once for its two blocks.
        values = [table(tokens) for table in self.value_embeds] if self.value_embeds is not None else []
        saved: dict[int, torch.Tensor] = {}  # block i's output (B, T, dim), for block n - 1 - i
        for name, block in self.layers.items():
            i = int(name)
            if self.skip_weights is not None and i >= n - half:
                j = n - 1 - i
                h = h + self.skip_weights[j] * saved.pop(j)
            table = self.args.value_table(i)
            extra = {"value": values[table]} if table is not None else {}
            h = block(h, ropes[kinds[name]], masks[kinds[name]], cache, i, **extra)
            if self.skip_weights is not None and i < half:
                saved[i] = h
        return h

    def lookup_tables(self) -> list[nn.Parameter]:
        tables = [] if self.value_embeds is None else [t.weight for t in self.value_embeds]
        return super().lookup_tables() + tables

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = super().logits(h)  # (B, T, V)
        cap = self.args.logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def init_rule(self, name: str) -> tuple:
        if name == "skip_weights":
            return ("ones",)
        if name.startswith("value_embeds."):
            return ("normal", 1.0)  # a lookup table, as the untied token embedding
        if name.endswith("attention.value_lambdas"):
            return ("constant", 0.5)
        if self.args.zero_init_projections and (name.endswith(RESIDUAL_OUT) or name == "output.weight"):
            return ("zeros",)
        return super().init_rule(name)


class ValueBlock(TransformerBlock):
    """Llama's block: a TransformerBlock whose attention may take the tokens' value embedding."""

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0,
                value: torch.Tensor | None = None):
        if value is None:
            return super().forward(x, rope, mask, cache, layer)
        x = x + self.attention(self.attention_norm(x), rope, mask, cache, layer, value=value)
        return x + self.feed_forward(self.ffn_norm(x))


def llama_tp_plan(args: LlamaArgs, sequence_parallel: bool) -> TPPlan:
    """The dense plan, its MLP gated or not as the args build it."""
    return dense_tp_plan(sequence_parallel, gated_mlp=args.ffn_activation == "swiglu", qk_norm=args.qk_norm)
