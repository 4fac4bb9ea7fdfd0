"""Gemma 4's attention and block (Gemma Team, Gemma 4 model card, 2026; built on Gemma 3,
arXiv 2503.19786, and Gemma 3n's per-layer embeddings and shared key/value layers).

What differs from Gemma 3's attention:

- Queries and keys are RMS-normalized per head (weights of their own, stored as the scale
  itself, not an offset from one), values too but without a weight; the scores are then not
  scaled at all (a scale of 1: the norms fix the logits' size).
- Global (full-attention) blocks have their own head width (`global_head_dim`, 512 in the
  released models against 256) and may have their own number of key/value heads; with
  `attention_k_eq_v` they have no value projection: the values are the key projection's
  output before the key norm and RoPE (then normalized like any values).
- Shared key/value layers (Gemma 3n's KV sharing): the last `kv_shared_layers` blocks have no
  key/value projections and attend over the keys and values of the last earlier block of
  their kind (the "producer"), which hands them on through a per-forward record, `shared`
  (`SharedKV`) keyed by layer type: under a KV cache what that block's cache holds, so a shared block
  writes no cache of its own; in training the producer's tensors themselves, whose gradient
  then sums over every block that reads them.

The block is Gemma's sandwich block plus the per-layer input (`ple`): after the feed-forward,
h += norm(W_up(gelu_tanh(W_gate h) * p_l)), p_l the block's slice of the per-layer embeddings
(forja/models/gemma4/model.py), and the block's output multiplied by `layer_scalar`, a stored
per-block constant (a buffer, not trained: the released checkpoints carry its value). With a
mixture of experts (forja/models/gemma4/moe.py) the experts run beside the dense MLP on the same
h, each output normalized on its own before their sum goes under post_ffn_norm. The mixture is
then the block's `feed_forward`, as in every forja block with experts (the tensor-parallel plan,
expert parallelism and the planner find it there), and the dense MLP beside it is `mlp`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forja.models.common.attention import Attention, AttentionMask, KVCache, attend, unit_rms
from forja.models.common.blocks import BlockStructure
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import apply_rope


class SharedKV:
    """The keys and values producer blocks hand on within one forward: layer type -> (keys
    (B, Hkv, Tk, hd), values (B, Hkv, Tk, hd)). A plain object rather than a dict: wrappers
    that map over a block's arguments (FSDP's casts) copy containers, not this."""

    def __init__(self):
        self.by_kind: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


class Gemma4Attention(Attention):
    """Grouped-query attention with per-head q/k norms, a weightless value norm and unscaled
    scores (`scale`: 1 in every Gemma 4). `kind`: the block's layer type, the key under which
    it stores (`store`) or reads (`shared`) keys and values. `shared`: the block owns no
    key/value projections. `k_eq_v`: no value projection, the values are the raw keys.

    An `Attention` by kind (the planner, QK-clip and max-logit tracking treat it as one: no
    output gate, no sinks) with parameters and a forward of its own."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, kind: str, norm_eps: float,
                 shared: bool = False, store: bool = False, k_eq_v: bool = False, scale: float = 1.0):
        nn.Module.__init__(self)  # Attention's own modules are not all Gemma 4's: built here
        self.wg = self.sinks = None
        self.head_dim, self.kind, self.store, self.scale, self.norm_eps = head_dim, kind, store, scale, norm_eps
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = None if shared else nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = None if shared or k_eq_v else nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps)
        self.k_norm = None if shared else RMSNorm(head_dim, norm_eps)

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"mixer": "attention"}

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask,
                cache: KVCache | None = None, layer: int = 0, shared: SharedKV | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of heads.
        q = apply_rope(self.q_norm(self.wq(x).view(B, T, -1, self.head_dim)), *rope).transpose(1, 2)  # (B, H, T, hd)
        if self.wk is None:  # a shared block: its producer's keys and values (whole cache included)
            if shared is None or self.kind not in shared.by_kind:
                raise ValueError(f"a shared key/value block of kind {self.kind!r} ran before its producer")
            k, v = shared.by_kind[self.kind]
        else:
            raw = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
            v = raw if self.wv is None else self.wv(x).view(B, T, -1, self.head_dim)
            k = apply_rope(self.k_norm(raw), *rope).transpose(1, 2)  # (B, Hkv, T, hd)
            v = unit_rms(v, self.norm_eps).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(layer, k, v)
            if self.store and shared is not None:
                shared.by_kind[self.kind] = (k, v)
        self.track_logits(q, k, mask, self.scale)
        out = attend(q, k, v, mask, scale=self.scale).transpose(1, 2).reshape(B, T, -1)  # (B, T, H * hd)
        return self.wo(out)


class Gemma4Block(nn.Module):
    """Gemma's sandwich block, then the per-layer input and the layer scalar:
    h = x + post_attention_norm(attn(attention_norm(x)));  h = h + post_ffn_norm(ffn(ffn_norm(h)));
    h = h + ple_norm(ple_proj(gelu_tanh(ple_gate(h)) * p));  out = h * layer_scalar.
    With a mixture of experts as `feed_forward` and `beside` = (the dense MLP, the norms of
    its output and of the experts'), ffn(ffn_norm(h)) becomes
    post_mlp_norm(mlp(ffn_norm(h))) + post_moe_norm(feed_forward(h))."""

    placement: ClassVar[str] = "sandwich"

    def __init__(self, attention: Gemma4Attention, feed_forward: nn.Module, norms: list[nn.Module],
                 ple: tuple[int, int, float] | None = None,
                 beside: tuple[nn.Module, nn.Module, nn.Module] | None = None):
        super().__init__()
        self.attention_norm, self.post_attention_norm, self.ffn_norm, self.post_ffn_norm = norms
        self.attention, self.feed_forward = attention, feed_forward
        self.mlp, self.post_mlp_norm, self.post_moe_norm = beside or (None, None, None)
        if ple is not None:  # (dim, per-layer width, eps)
            dim, width, eps = ple
            self.ple_gate = nn.Linear(dim, width, bias=False)
            self.ple_proj = nn.Linear(width, dim, bias=False)
            self.ple_norm = RMSNorm(dim, eps)
        else:
            self.ple_gate = self.ple_proj = self.ple_norm = None
        # A stored constant per block (checkpoints carry it; 1 in a model trained from scratch).
        self.register_buffer("layer_scalar", torch.ones(1))
        self.structure = replace(BlockStructure.of(self.placement, attention, feed_forward, self.attention_norm),
                                 gemma4=self._shape())

    def _shape(self) -> tuple[int, ...]:
        """`BlockStructure.gemma4`: the planner prices each block by its own heads and widths (a
        global block's wider heads, a shared block's borrowed keys and values, a double-wide or
        a dense GeGLU beside experts, the per-layer input), not the model's."""
        attn, dense = self.attention, self.mlp or self.feed_forward
        kv_heads = 0 if attn.wk is None else attn.wk.out_features // attn.head_dim
        k_eq_v = int(attn.wk is not None and attn.wv is None)
        ple = 0 if self.ple_gate is None else self.ple_gate.out_features
        return (attn.wq.out_features // attn.head_dim, kv_heads, attn.head_dim, k_eq_v, dense.w1.out_features, ple)

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0,
                per_layer: torch.Tensor | None = None, shared: SharedKV | None = None):
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, mask, cache, layer, shared))
        if self.mlp is None:
            ffn = self.feed_forward(self.ffn_norm(h))  # (B, T, dim)
        else:  # the experts read h itself: their router and input norm are their own
            ffn = self.post_mlp_norm(self.mlp(self.ffn_norm(h))) + self.post_moe_norm(self.feed_forward(h))
        h = h + self.post_ffn_norm(ffn)
        if self.ple_gate is not None:
            gated = F.gelu(self.ple_gate(h), approximate="tanh") * per_layer  # (B, T, P)
            h = h + self.ple_norm(self.ple_proj(gated))
        return h * self.layer_scalar

    def init_buffers(self) -> None:
        """The layer scalar starts at one (called by the model's init_weights)."""
        with torch.no_grad():
            self.layer_scalar.fill_(1.0)
