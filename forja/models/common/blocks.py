"""The transformer blocks families are made of, and the structure record each one declares.

Three placements of the norms: pre-norm (Llama: a norm before each sublayer), post-norm
(OLMo 2/3: a norm on each sublayer's output, before the residual add) and sandwich (Gemma:
both). Any sequence mixer (attention, latent attention, Gated DeltaNet) and any
feed-forward (SwiGLU, GeGLU, GELU, a mixture of experts) fits each; the block is called
as block(x, rope, mask, cache, layer) whatever it holds.

Each block records what it is made of in `structure`, a `BlockStructure` built when the
block is, from the parts it was given: the memory and speed model (forja/plan) prices a
block by that record, never by probing the block's attribute names, so renaming a module
cannot silently re-price it. Each part says what it adds to the record (`structure_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torch import nn

from forja.models.common.attention import KVCache


@dataclass(frozen=True)
class BlockStructure:
    """What one block is made of, as far as its memory and time depend on it."""

    norms: Literal["pre", "post", "sandwich"]
    """Where the block normalizes: before each sublayer, on each sublayer's output, or both."""
    norm: Literal["rms", "zero_centered", "layer"]
    """Its norms: RMSNorm, RMSNorm scaling by (1 + w) in fp32 (Gemma, Qwen3.5), or LayerNorm."""
    mixer: Literal["attention", "latent_attention", "gated_deltanet", "kimi_delta_attention", "mamba2", "none"]
    """Its sequence mixer; "none" in a block that is only a feed-forward (`FeedForwardBlock`).
    Kimi Delta Attention records its shape in `gated_deltanet` (as many key as value heads)."""
    ffn: Literal["swiglu", "geglu", "gelu", "relu2", "moe", "none"]
    """Its feed-forward; "none" in a block that is only a sequence mixer (`MixerBlock`)."""
    output_gate: bool = False
    """Attention's output gate: sigmoid(x W_g) times each head's output (Qwen3.5)."""
    sinks: bool = False
    """Attention sinks: a learned logit per head in the softmax (gpt-oss)."""
    gated_deltanet: tuple[int, ...] = ()
    """A Gated DeltaNet mixer as built: (key heads, value heads, key width, value width,
    convolution taps, chunk size); () for the other mixers."""
    mamba2: tuple[int, ...] = ()
    """A Mamba-2 mixer as built: (heads, head width, groups, state size, convolution taps,
    chunk size); () for the other mixers."""
    expert_activation: str = ""
    """A mixture of experts' activation ("swiglu", "clamped_swiglu", "relu2"); "" without experts."""
    shared_expert_gate: bool = False
    """A mixture of experts' shared expert is scaled by a per-token sigmoid gate."""
    expert_width: int = 0
    """The width a mixture of experts' routed experts compute in where it projects their input
    down and their sum back up (Nemotron 3 Super's latent experts); 0: the model's width."""
    unit_qk: bool = False
    """Attention divides each head's query and key by their RMS, without a weight (Llama 4's
    rotary layers: `Attention(unit_qk=True)`)."""
    indexer: tuple[int, ...] = ()
    """DeepSeek Sparse Attention's lightning indexer as built (forja/models/common/sparse_attention.py):
    (indexer heads, indexer head width, top-k keys, dsa_stage: 0 untrained, 1 dense warm-up, 2 sparse);
    () without."""
    gemma4: tuple[int, ...] = ()
    """A Gemma 4 block as built (forja/models/gemma4/attention.py), whose shapes are its own, not
    the model's: (query heads, key/value heads it projects (0 where it reads another block's),
    head width, values = keys (1) or not (0), its dense GeGLU's width, per-layer input width);
    () in other families' blocks."""

    @classmethod
    def of(cls, norms: str, mixer: nn.Module, feed_forward: nn.Module, norm: nn.Module) -> BlockStructure:
        """The record of a block with norm placement `norms` built from these parts (`norm`:
        any one of its norms), each part giving its own fields."""
        return cls(norms=norms, **mixer.structure_fields(), **feed_forward.structure_fields(),
                   **norm.structure_fields())


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    placement: ClassVar[str] = "pre"

    def __init__(self, attention: nn.Module, feed_forward: nn.Module, attention_norm: nn.Module,
                 ffn_norm: nn.Module):
        super().__init__()
        # Registered in the order they run (parameter names and order, as checkpoints hold them).
        self.attention_norm, self.attention, self.ffn_norm, self.feed_forward = (attention_norm, attention, ffn_norm,
                                                                                 feed_forward)
        self.structure = BlockStructure.of(self.placement, attention, feed_forward, attention_norm)

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0):
        x = x + self.attention(self.attention_norm(x), rope, mask, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class PostNormBlock(nn.Module):
    """OLMo 2/3's block: each sublayer reads the raw residual stream and its output is
    normalized before the add."""

    placement: ClassVar[str] = "post"

    def __init__(self, attention: nn.Module, feed_forward: nn.Module, post_attention_norm: nn.Module,
                 post_ffn_norm: nn.Module):
        super().__init__()
        self.attention, self.post_attention_norm = attention, post_attention_norm
        self.feed_forward, self.post_ffn_norm = feed_forward, post_ffn_norm
        self.structure = BlockStructure.of(self.placement, attention, feed_forward, post_attention_norm)

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0):
        h = x + self.post_attention_norm(self.attention(x, rope, mask, cache, layer))  # (B, T, dim)
        return h + self.post_ffn_norm(self.feed_forward(h))


class SandwichBlock(nn.Module):
    """A norm before each sublayer and one on its output (Gemma):
    h = x + post_attention_norm(attn(attention_norm(x))), out = h + post_ffn_norm(ffn(ffn_norm(h)))."""

    placement: ClassVar[str] = "sandwich"

    def __init__(self, attention: nn.Module, feed_forward: nn.Module, norms: list[nn.Module]):
        super().__init__()
        self.attention_norm, self.post_attention_norm, self.ffn_norm, self.post_ffn_norm = norms
        self.attention = attention
        self.feed_forward = feed_forward
        self.structure = BlockStructure.of(self.placement, attention, feed_forward, self.attention_norm)

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0):
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, mask, cache, layer))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))  # (B, T, dim)


class MixerBlock(nn.Module):
    """A block that is only a sequence mixer: x + attn(norm(x)) (Nemotron-H's Mamba-2 and
    attention blocks, each its own residual block with no feed-forward)."""

    placement: ClassVar[str] = "pre"

    def __init__(self, attention: nn.Module, attention_norm: nn.Module):
        super().__init__()
        self.attention_norm, self.attention = attention_norm, attention
        self.structure = BlockStructure(norms="pre", ffn="none", **attention.structure_fields(),
                                        **attention_norm.structure_fields())

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0):
        return x + self.attention(self.attention_norm(x), rope, mask, cache, layer)


class FeedForwardBlock(nn.Module):
    """A block that is only a feed-forward: x + ffn(norm(x)) (Nemotron-H's MLP blocks); it
    takes a block's call and ignores rope, mask and cache."""

    placement: ClassVar[str] = "pre"

    def __init__(self, feed_forward: nn.Module, ffn_norm: nn.Module):
        super().__init__()
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward
        self.structure = BlockStructure(norms="pre", mixer="none", **feed_forward.structure_fields(),
                                        **ffn_norm.structure_fields())

    def forward(self, x, rope=None, mask=None, cache: KVCache | None = None, layer: int = 0):
        return x + self.feed_forward(self.ffn_norm(x))
