"""Gemma 4's text decoder (Gemma Team, Gemma 4 model card, 2026), single-device: Gemma 3
(arXiv 2503.19786; forja/models/gemma3) with Gemma 3n's per-layer embeddings and shared
key/value layers, and attention of its own (forja/models/gemma4/attention.py).

What it adds to Gemma 3:

- Per-layer embeddings (PLE): a second table, `ple_embeddings` (ple_vocab_size, n_layers * P),
  gives every token a P-wide vector for each block, scaled by sqrt(P); a projection of the
  (sqrt(dim)-scaled) input embedding, `ple_projection` (dim -> n_layers * P) times dim^-1/2, then
  RMS-normalized over each P-wide slice (`ple_projection_norm`), is added and the sum
  multiplied by 2^-1/2. Block l reads its slice p_l (`Gemma4Block`).
- Shared key/value layers: the last `kv_shared_layers` blocks reuse the keys and values of the
  last earlier block of their kind; with `double_wide_mlp` their feed-forward is twice as wide.
- Global blocks with their own head width and key/value heads, RoPE on a fraction of their
  frequencies ("proportional" RoPE: the first global_rotary_fraction * hd/2 frequencies of
  base rope_theta over the whole width, the others zero, so those dimensions pass through).
- Norm weights are the scale itself (not Gemma 3's offset from one), unscaled attention
  scores, a per-block stored `layer_scalar`, final logits soft-capped (30 in the releases).
- Optionally (`n_experts` > 0, transformers' `enable_moe_block`: the 26B-A4B) a mixture of
  GeGLU experts beside every block's dense MLP (forja/models/gemma4/moe.py).

Under pipeline parallelism a stage past the first receives the hidden states and, beside them
in the same tensor, the per-layer inputs of its blocks and of the later ones (`stage_widths`);
the shared key/value blocks sit in one stage with the blocks they read (`pipeline_spans`).

Parameter names follow the TP plan (`parallelize.py`): attention.wq/wk/wv/wo, attention.q_norm/
k_norm, feed_forward.w1 (gate)/w3 (up)/w2 (down), ple_gate/ple_proj/ple_norm in each block; with
experts feed_forward.router.gate/norm/per_expert_scale, feed_forward.expert_norm,
feed_forward.experts.w1/w3/w2, and the dense MLP beside them mlp.w1/w3/w2, post_mlp_norm and
post_moe_norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forja.errors import ForjaError
from forja.models.common.attention import KVCache, SequenceShards
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.mlp import GeGLU
from forja.models.common.moe import MoEArgs
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import rope_frequencies
from forja.models.gemma3.model import Gemma3, Gemma3Args, gemma3_layer_types
from forja.models.gemma4.attention import Gemma4Attention, Gemma4Block, SharedKV
from forja.models.gemma4.moe import Gemma4MoE


@dataclass(kw_only=True)
class Gemma4Args(Gemma3Args, MoEArgs):
    """A Gemma 4 text model's shape; the package's FLAVORS hold the published sizes. Of Gemma 3's
    fields, rope_linear_factor scales the global blocks' frequencies (proportional RoPE's
    `factor`) and query_pre_attn_scalar stays 1 (scores unscaled); rope_scaling is not used.
    With n_experts > 0 every block has experts beside its dense MLP (MoEArgs: n_experts,
    top_k, moe_ffn_dim; a softmax router renormalizing its top k, as transformers')."""

    query_pre_attn_scalar: int | None = 1
    """Attention scores are multiplied by query_pre_attn_scalar ** -0.5: 1 in Gemma 4."""
    sliding_window: int | None = 512
    """Positions a sliding (local) block sees, itself included (512 in the releases)."""
    global_head_dim: int | None = None
    """Head width of the global (full-attention) blocks (`global_head_dim`); None: head_dim."""
    global_kv_heads: int | None = None
    """Key/value heads of the global blocks (`num_global_key_value_heads`); None: n_kv_heads."""
    global_rotary_fraction: float = 0.25
    """Share of a global head's rotary frequencies that turn (proportional RoPE's
    `partial_rotary_factor`); 1: all of them, plain RoPE."""
    attention_k_eq_v: bool = False
    """Global blocks have no value projection: values are the key projection's output."""
    kv_shared_layers: int = 0
    """The last this many blocks reuse the keys and values of the last earlier block of their
    kind (`num_kv_shared_layers`); 0: every block has its own."""
    double_wide_mlp: bool = False
    """The shared key/value blocks' feed-forward is 2 * ffn_dim wide (`use_double_wide_mlp`)."""
    ple_dim: int = 0
    """Width P of each block's per-layer embedding (`hidden_size_per_layer_input`); 0: none."""
    ple_vocab_size: int = 0
    """Rows of the per-layer embedding table (`vocab_size_per_layer_input`); 0: vocab_size."""
    expert_activation: str = "geglu"
    """The experts' activation (MoEArgs): Gemma 4's are GeGLUs, gelu_tanh(gate) * up."""

    def __post_init__(self) -> None:
        if not self.layer_types:  # transformers' default: five local blocks to one global, the last global
            self.layer_types = (*gemma3_layer_types(self.n_layers)[:-1], "full_attention")
        super().__post_init__()
        if self.global_head_dim is None:
            self.global_head_dim = self.head_dim
        if self.global_kv_heads is None:
            self.global_kv_heads = self.n_kv_heads
        if self.ple_dim and not self.ple_vocab_size:
            self.ple_vocab_size = self.vocab_size
        self._check_gemma4()
        self.check_moe()

    def _check_gemma4(self) -> None:
        if self.rope_scaling is not None:
            raise ForjaError("model.rope_scaling is not used by Gemma 4, whose global blocks scale by "
                             "rope_linear_factor; remove rope_scaling")
        if self.mtp_depth:
            raise ForjaError(f"model.mtp_depth = {self.mtp_depth}: Gemma 4 has no multi-token prediction; set it to 0")
        if self.n_heads % self.global_kv_heads:
            raise ForjaError(f"model.n_heads={self.n_heads} is not a multiple of model.global_kv_heads="
                             f"{self.global_kv_heads}; grouped-query attention needs whole groups")
        if not 0.0 <= self.global_rotary_fraction <= 1.0:
            raise ForjaError(f"model.global_rotary_fraction={self.global_rotary_fraction} must be between 0 and 1")
        if min(self.ple_dim, self.ple_vocab_size) < 0:
            raise ForjaError(f"model.ple_dim={self.ple_dim} and ple_vocab_size={self.ple_vocab_size} must be >= 0")
        if not 0 <= self.kv_shared_layers < self.n_layers:
            raise ForjaError(f"model.kv_shared_layers={self.kv_shared_layers} must be between 0 and n_layers - 1 "
                             f"= {self.n_layers - 1}: the shared blocks need an earlier block to read from")
        first = self.first_shared_layer
        lacking = {self.layer_type(i) for i in range(first, self.n_layers)} - \
            {self.layer_type(i) for i in range(first)}
        if lacking:
            raise ForjaError(f"model.kv_shared_layers={self.kv_shared_layers} leaves {sorted(lacking)[0]} blocks "
                             "with no earlier block of their kind to share keys and values; share fewer layers")

    @property
    def first_shared_layer(self) -> int:
        """The first block that reuses another's keys and values (n_layers: none does)."""
        return self.n_layers - self.kv_shared_layers

    def producer(self, layer: int) -> int:
        """The block whose keys and values `layer` attends over: itself, or for a shared block
        the last block of its kind before the first shared one."""
        first = self.first_shared_layer
        if layer < first:
            return layer
        kind = self.layer_type(layer)
        return max(i for i in range(first) if self.layer_type(i) == kind)

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(key/value heads, head width) of block `layer`'s attention."""
        if self.layer_type(layer) == "full_attention":
            return self.global_kv_heads, self.global_head_dim
        return self.n_kv_heads, self.head_dim

    def head_counts(self) -> dict[str, int]:
        return {**super().head_counts(), "global_kv_heads": self.global_kv_heads}

    def pipeline_spans(self) -> list[tuple[int, int, str]]:
        """The shared key/value blocks and every block they read from, in one pipeline stage:
        a producer hands its keys and values on within the forward, not between stages."""
        if not self.kv_shared_layers:
            return []
        first, last = min(self.producer(i) for i in range(self.first_shared_layer, self.n_layers)), self.n_layers - 1
        return [(first, last, f"Gemma 4's shared key/value blocks {self.first_shared_layer}-{last} read the keys "
                              f"and values of blocks from {first} on")]


class Gemma4(Gemma3):
    """Gemma 3's embedding scale, local/global RoPE bases and soft-capped logits, with Gemma 4's
    blocks, per-layer embeddings and shared key/value layers."""

    args: Gemma4Args

    def __init__(self, args: Gemma4Args):
        super().__init__(args)
        L, P = args.n_layers, args.ple_dim
        self.ple_embeddings: nn.Module | None = nn.Embedding(args.ple_vocab_size, L * P) if P else None
        self.ple_projection: nn.Module | None = nn.Linear(args.dim, L * P, bias=False) if P else None
        self.ple_projection_norm: nn.Module | None = RMSNorm(P, args.norm_eps) if P else None

    def build_block(self, layer: int) -> Gemma4Block:
        a = self.args
        kind = a.layer_type(layer)
        kv_heads, head_dim = a.attention_shape(layer)
        shared = layer >= a.first_shared_layer
        # The last block of each kind before the shared ones hands its keys and values on.
        store = not shared and any(a.producer(i) == layer for i in range(a.first_shared_layer, a.n_layers))
        attention = Gemma4Attention(a.dim, a.n_heads, kv_heads, head_dim, kind=kind, norm_eps=a.norm_eps,
                                    shared=shared, store=store, k_eq_v=a.attention_k_eq_v and kind == "full_attention",
                                    scale=a.query_pre_attn_scalar**-0.5)
        width = a.ffn_dim * (2 if a.double_wide_mlp and shared else 1)
        ple = (a.dim, a.ple_dim, a.norm_eps) if a.ple_dim else None
        norms = [self.build_norm() for _ in range(4)]
        if not a.is_moe_layer(layer):
            return Gemma4Block(attention, GeGLU(a.dim, width), norms, ple)
        beside = (GeGLU(a.dim, width), self.build_norm(), self.build_norm())  # the dense MLP, both outputs' norms
        return Gemma4Block(attention, Gemma4MoE(a.dim, a, a.norm_eps), norms, ple, beside)

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps)

    def rope_frequencies(self) -> torch.Tensor:
        """The global blocks' proportional RoPE: the first global_rotary_fraction of the
        global_head_dim / 2 frequencies of base rope_theta over the whole head, zeros after
        (cos 1, sin 0: those dimensions pass unturned), all divided by rope_linear_factor."""
        a = self.args
        freqs = rope_frequencies(a.global_head_dim, a.rope_theta)  # (hd / 2,)
        turning = int(a.global_rotary_fraction * a.global_head_dim // 2)
        freqs[turning:] = 0.0
        return freqs / a.rope_linear_factor

    def init_rule(self, name: str) -> tuple:
        """Llama's rule (norm weights, the scales themselves, start at one), except each
        block's query norm, which starts at hd^-1/2 (hd: that block's head width).

        Gemma 4 leaves its scores unscaled and lets the q/k norm scales set their size; at
        one, unit-RMS queries and keys give scores of std sqrt(hd) (5.7 to 22 here and in the
        releases), a near-one-hot softmax from the first step whose gradients are so badly
        conditioned that two summation orders of the same batch (micro-batching, FSDP, CP)
        part by 1e-4 in loss within four steps. Starting the query scale at hd^-1/2 gives
        standard attention's scores q.k / sqrt(hd) at step 0 (a checkpoint's loaded values
        replace it). On the query side only: a shared block has no key norm of its own."""
        if name.endswith("attention.q_norm.weight") and name.startswith("layers."):
            head_dim = self.args.attention_shape(int(name.split(".")[1]))[1]
            return ("uniform", head_dim**-0.5, head_dim**-0.5)  # a constant: U(c, c) draws c
        if name.endswith("router.per_expert_scale"):
            return ("ones",)  # each expert's weight as routed, as transformers starts it
        return RotaryDecoder.init_rule(self, name)

    # -- per-layer embeddings ----------------------------------------------------------------
    def per_layer_inputs(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """tokens (B, T) and their scaled embeddings (B, T, dim) -> each block's per-layer
        input (B, T, n_layers, P); None without per-layer embeddings."""
        if self.ple_embeddings is None:
            return None
        a = self.args
        B, T = embedded.shape[:2]  # under sequence parallelism the rank's slice, as the table's output
        table = self.ple_embeddings.weight
        own = self.ple_embeddings(tokens) * torch.tensor(a.ple_dim**0.5, dtype=table.dtype, device=table.device)
        context = self.ple_projection(embedded) * a.dim**-0.5  # (B, T, L * P)
        context = self.ple_projection_norm(context.view(B, T, a.n_layers, a.ple_dim))
        return (context + own.view(B, T, a.n_layers, a.ple_dim)) * 2.0**-0.5  # (B, T, L, P)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: KVCache | None = None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, sequence: SequenceShards | None = None) -> torch.Tensor:
        """As `Transformer.forward` (tokens (B, T) -> logits (B, T, vocab), or with labels the
        mean loss), each block also given its per-layer input and the forward's shared keys and
        values. A pipeline stage past the first receives, as `tokens`, what the stage before
        sent (`stage_output`); a stage before the last returns what it sends on."""
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        T = positions.shape[0]
        first, end = self.stage_layers()
        if self.tok_embeddings is not None:
            h = self.add_positions(self.tok_embeddings(tokens), positions)  # (B, T, dim)
            per_layer = self.per_layer_inputs(tokens, h)  # (B, T, L, P) or None
            first = 0  # the per-layer inputs start at block 0 whatever blocks this stage holds
        else:
            h, per_layer = self.stage_input(tokens, first)  # (B, T, dim), (B, T, L - first, P) or None
        kinds = {name: self.args.layer_type(int(name)) for name in self.layers}
        ropes = {kind: self.rope_tables_for(kind, positions) for kind in set(kinds.values())}
        masks = {kind: self.mask_for(kind, document_ids, T, start, tokens.device, sequence) for kind in ropes}
        shared = SharedKV()
        for name, block in self.layers.items():
            i = int(name)
            # per_layer and shared by keyword: a later pipeline stage's first block has a layout hook
            # for the usual five positional inputs under sequence parallelism (forja/parallel/tp.py).
            h = block(h, ropes[kinds[name]], masks[kinds[name]], cache, i,
                      per_layer=None if per_layer is None else per_layer[:, :, i - first], shared=shared)
        if cache is not None:
            cache.advance(T)
        if self.output is None:
            return self.stage_output(h, per_layer, end - first)
        h = self.norm(h)
        return self.logits(h) if labels is None else self.loss(h, labels)

    # -- pipeline stages ---------------------------------------------------------------------
    def stage_layers(self) -> tuple[int, int]:
        """(first block, one past the last) this model or pipeline stage holds; a stage of no
        blocks sits before block 0 (the first) or after the last."""
        held = [int(name) for name in self.layers]
        if held:
            return min(held), max(held) + 1
        at = 0 if self.tok_embeddings is not None else self.args.n_layers
        return at, at

    def stage_widths(self) -> tuple[int, int]:
        """Widths of the hidden states a pipeline stage receives and sends: dim, and P for each
        later block's per-layer input (Transformer.stage_widths)."""
        a = self.args
        first, end = self.stage_layers()
        return a.dim + (a.n_layers - first) * a.ple_dim, a.dim + (a.n_layers - end) * a.ple_dim

    def stage_input(self, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a stage receives, x (B, T, dim + (L - first) P) -> hidden states (B, T, dim) and
        the per-layer inputs of blocks first.. (B, T, L - first, P), or None without them."""
        a = self.args
        if not a.ple_dim:
            return x, None
        per_layer = x[..., a.dim:].unflatten(-1, (a.n_layers - first, a.ple_dim))
        if isinstance(per_layer, DTensor):  # sequence parallel: the blocks take the rank's slice (B, T / tp, ...)
            per_layer = per_layer.to_local()
        return x[..., :a.dim], per_layer

    @staticmethod
    def stage_output(h: torch.Tensor, per_layer: torch.Tensor | None, done: int) -> torch.Tensor:
        """What a stage sends on: the hidden states (B, T, dim) and the per-layer inputs past the
        `done` blocks of `per_layer` it ran, (B, T, dim + (rest) P) in one tensor (a pipeline
        schedule moves one)."""
        if per_layer is None:
            return h
        return torch.cat([h, per_layer[:, :, done:].flatten(2).to(h.dtype)], dim=-1)

    # -- cache, counts, FLOPs ----------------------------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """Buffers for the blocks that own keys and values, each of its own shape (global
        blocks' head width and heads); shared blocks read their producer's."""
        a = self.args
        weight = self.tok_embeddings.weight
        max_len = max_len or a.max_seq_len
        own = list(range(a.first_shared_layer))
        cache = KVCache(a.n_layers, batch, max_len, a.n_kv_heads, a.head_dim, dtype=weight.dtype,
                        device=weight.device, layers=[i for i in own if a.layer_type(i) == "sliding_attention"])
        for i in own:
            if a.layer_type(i) == "full_attention":
                heads, width = a.attention_shape(i)
                shape = (batch, heads, max_len, width)
                cache.keys[i] = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
                cache.values[i] = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        return cache

    def lookup_tables(self) -> list[nn.Parameter]:
        """The token embedding when untied and the per-layer embedding table: lookups, no matmul."""
        tables = super().lookup_tables()
        return tables + ([self.ple_embeddings.weight] if self.ple_embeddings is not None else [])

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """12 H hd T per block, hd the kind's head width (global blocks' wider), T the keys a
        query sees (at most sliding_window in a local block)."""
        a = self.args
        if kind == "full_attention":
            return 12 * a.n_heads * a.global_head_dim * seq_len
        return 12 * a.n_heads * a.head_dim * min(seq_len, a.sliding_window)
