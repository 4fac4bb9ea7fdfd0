"""The decoder-only transformer shared by every family: embed -> blocks -> norm -> output.

A family (llama/, gpt2/) chooses the norm, the MLP, the position scheme and the
initialization; the forward pass, parameter and FLOP counting live here once.
Single-device code: parallelism is applied from outside, by the family's TP plan.

Layers sit in an `nn.ModuleDict` keyed "0", "1", ... so that a pipeline stage that
drops some of them keeps the others' parameter names (checkpoints stay compatible).
Any of `tok_embeddings`, `norm`, `output` may be set to None by a pipeline split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import ATTENTION_BACKENDS, AttentionMask, KVCache, SequenceShards, build_mask
from forja.models.common.blocks import TransformerBlock
from forja.models.common.init import InitRule, init_parameters
from forja.models.common.moe import MoE
from forja.models.common.mtp import MultiTokenPrediction
from forja.names import named_unique_parameters


@dataclass(kw_only=True)
class TransformerArgs:
    """Sizes and switches common to every family."""

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per attention layer."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means n_heads."""
    head_dim: int | None = None
    """Width of one head; None means dim // n_heads."""
    ffn_dim: int
    """Hidden width of the feed-forward block."""
    vocab_size: int
    """Rows of the embedding and of the output projection."""
    max_seq_len: int = 2048
    """Longest sequence the model is built for (learned positions, KV cache size)."""
    learned_positions: ClassVar[bool] = False
    """Whether max_seq_len sizes a weight (a learned position table): such a model cannot be
    resumed at a longer context; a rotary one computes its positions and can."""
    norm_eps: float = 1e-5
    """Epsilon of the normalization layers."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    qk_norm: bool = False
    """RMS-normalize queries and keys per head before attention."""
    attention: str = "sdpa"
    """Attention backend: "sdpa", or "flex" (FlexAttention on CUDA; SDPA elsewhere)."""
    sliding_window: int | None = None
    """Each token of a sliding-attention block attends to at most this many latest positions
    (itself included); None: all."""
    attention_sinks: bool = False
    """A learned logit per attention head that joins each softmax with no value, so a head
    may attend to nothing (gpt-oss)."""
    layer_types: tuple[str, ...] = ()
    """Each block's sequence mixer, one of LAYER_TYPES (Hugging Face's `layer_types`):
    full_attention, sliding_attention (the latest `sliding_window` positions) or
    linear_attention (a recurrent mixer such as Gated DeltaNet). Empty: every block sliding
    when `sliding_window` is set, else full."""
    fused_ops: tuple[str, ...] = ()
    """Ops run through forja.ops (Triton on CUDA, the PyTorch reference elsewhere): any of
    rms_norm, rope, swiglu, cross_entropy. An implementation choice: weights are the same."""
    mup_width_mult: float = 1.0
    """muP's width multiplier, dim / the width the hyperparameters were tuned at (set from
    model.mup_base_dim); 1 is the standard parametrization. See `mup_init_rule`."""
    mtp_depth: int = 0
    """Multi-token prediction modules after the main model (DeepSeek-V3's MTP,
    forja/models/common/mtp.py; Hugging Face `num_nextn_predict_layers`); 0: none."""
    mtp_loss_weight: float = 0.3
    """lambda of L_MTP = (lambda / mtp_depth) * sum of the depths' losses, added to the
    training loss (DeepSeek-V3: 0.3, then 0.1 for the last 4.8T tokens)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ForjaError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                                 "change one of them or set model.head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ForjaError(f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                             f"{self.n_kv_heads}; grouped-query attention needs whole groups")
        if self.attention not in ATTENTION_BACKENDS:
            raise ForjaError(f"model.attention={self.attention!r} is not one of {ATTENTION_BACKENDS}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ForjaError(f"model sliding_window={self.sliding_window} must be at least 1 (or None for all)")
        self._check_layer_types()
        self.fused_ops = tuple(self.fused_ops)
        if self.mup_width_mult <= 0:
            raise ForjaError(f"model mup_width_mult={self.mup_width_mult} must be positive (1: muP off)")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ForjaError(f"model.mtp.depth = {self.mtp_depth} and model.mtp.loss_weight = "
                             f"{self.mtp_loss_weight} must be at least 0 (depth 0: no multi-token prediction)")

    def _check_layer_types(self) -> None:
        self.layer_types = tuple(self.layer_types)  # a list from TOML or config.json
        if not self.layer_types:
            return
        if len(self.layer_types) != self.n_layers:
            raise ForjaError(f"model.layer_types names {len(self.layer_types)} blocks but model.n_layers="
                             f"{self.n_layers}; give one kind per block, or none")
        unknown = sorted(set(self.layer_types) - set(self.supported_layer_types))
        if unknown:
            raise ForjaError(f"model.layer_types holds {unknown[0]!r}; each must be one of "
                             f"{', '.join(self.supported_layer_types)} (this family's kinds of block)")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ForjaError("model.layer_types has sliding_attention blocks but model.sliding_window is None; "
                             "set the window (in tokens)")

    def split_counts(self) -> dict[str, int]:
        """The model fields tensor parallelism splits whole over its ranks (heads, the
        feed-forward's width), by name: each must be divisible by parallel.tp."""
        return {**self.head_counts(), "ffn_dim": self.ffn_dim}

    def head_counts(self) -> dict[str, int]:
        """The heads of every kind of sequence mixer, by field name (tensor parallelism and
        all-to-all context parallelism hand out whole heads)."""
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}

    def layout_limits(self) -> dict[str, str]:
        """What of this model cannot take a parallel axis yet, by axis: "tp" (no tensor-parallel
        plan), "cp" (blocks that cannot run on a sequence split over ranks), "pp" (parts a
        pipeline stage cannot run: a stage sees only the hidden states of the one before); and
        "documents": parts that cannot keep packed documents apart (model.document_mask), and
        "cp_documents": parts that can, but not with the rows split over ranks. The preflight
        refuses that axis above 1 (or document masks) naming them; {}: none."""
        return {}

    def pipeline_spans(self) -> list[tuple[int, int, str]]:
        """Runs of blocks (first, last, why) that must sit in one pipeline stage, because they
        hand each other more than the hidden states (Gemma 4's shared key/value blocks and the
        blocks they read); []: a stage may end after any block (forja/parallel/pp_split.py)."""
        return []

    @property
    def supported_layer_types(self) -> tuple[str, ...]:
        """The kinds of block the family builds: attention, full or sliding, unless it says more."""
        return ATTENTION_TYPES

    def layer_type(self, layer: int) -> str:
        """The kind of block `layer`'s sequence mixer (one of LAYER_TYPES). Past the main
        layers (a multi-token prediction module's block): full attention."""
        if layer >= self.n_layers:
            return "full_attention"
        if self.layer_types:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"


# The kinds of sequence mixer a block can hold (TransformerArgs.layer_types).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ATTENTION_TYPES = ("full_attention", "sliding_attention")

# The name a tied embedding/output weight is stored and initialized under.
TIED_WEIGHT = "tok_embeddings.weight"

# Parameters muP leaves at their standard init: lookup tables (an embedding's coordinates do
# not sum over the width) and the output projection (muP scales its logits in forward instead).
MUP_UNSCALED = ("tok_embeddings.weight", "pos_embeddings.weight", "output.weight")


def mup_init_rule(rule: InitRule, width_mult: float, ndims: dict[str, int]) -> InitRule:
    """`rule` under muP (Yang et al. 2021, "Tensor Programs V"), the variant with an output
    multiplier: every hidden weight (>= 2-D, not in MUP_UNSCALED; routers and experts
    included) draws with its std divided by sqrt(width_mult), i.e. its variance keeps
    scaling as 1/fan_in from the tuned width on. Embeddings, norms and biases are unchanged;
    the logits are multiplied by 1/width_mult in forward (`Transformer.logits`), the output
    weight keeping its init and learning rate. The attention scale stays 1/sqrt(head_dim)
    (muP's 1/head_dim matters only when head_dim grows; forja widens by adding heads).
    The learning-rate side is `forja.optim.mup`."""
    if width_mult == 1.0:
        return rule
    shrink = width_mult**-0.5

    def scaled(name: str) -> tuple:
        base = rule(name)
        if base[0] in ("normal", "trunc_normal") and ndims.get(name, 0) >= 2 and name not in MUP_UNSCALED:
            return (base[0], base[1] * shrink)
        return base

    return scaled


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against labels (B, T), computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class Transformer(nn.Module):
    """Base of every family's model. Subclasses build the modules and define
    `positions_embedding`, `rope_tables` and `init_rule`."""

    args: TransformerArgs
    output_side: ClassVar[tuple[str, ...]] = ("norm", "output", "mtp")
    """The model's own modules besides `layers` that read the last block's output: a pipeline's
    last stage holds them; every other one feeds the first block (forja/parallel/pp_split.py)."""
    stages_read_tokens: ClassVar[bool] = False
    """Whether blocks read the token ids (DeepSeek-V4's hash routing): the pipeline then hands
    every stage its micro-batch's ids as the keyword `token_ids` (forja/parallel/pp.py)."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.n_layers)})
        self.norm: nn.Module | None = self.build_norm()
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp: MultiTokenPrediction | None = self.build_mtp() if args.mtp_depth else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the args say so.

        Call again after `to_empty`: moving off the meta device gives each module a new
        Parameter and silently unties them."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def tied_parameters(self) -> dict[str, str]:
        """The parameters holding the tied embedding, by name -> the one name it is known by
        in checkpoints and initialization ("tok_embeddings.weight"); {} when untied.

        In the whole model both names share one Parameter. A pipeline split puts them on
        different stages: the last stage then holds its own copy as `output.weight`,
        initialized like the embedding and kept equal to it by summing the two copies'
        gradients every step (Megatron-LM's scheme). Multi-token prediction on a pipeline's
        last stage reads the embedding too: its copy `mtp.embed.weight` is kept the same way,
        tied output or not."""
        names = {}
        if self.args.tie_embeddings:
            names = {f"{n}.weight": TIED_WEIGHT for n in ("tok_embeddings", "output") if getattr(self, n) is not None}
        mtp_copy = self.mtp is not None and self.mtp.embed is not None  # a pipeline's last stage
        first_stage = self.args.mtp_depth and self.mtp is None and self.tok_embeddings is not None
        if mtp_copy:
            names["mtp.embed.weight"] = TIED_WEIGHT
        if mtp_copy or first_stage:  # both ends hold a copy whose gradients are summed
            if self.tok_embeddings is not None:
                names["tok_embeddings.weight"] = TIED_WEIGHT
        return names

    # -- what a family defines -------------------------------------------------------------
    def build_block(self, layer: int) -> TransformerBlock:
        raise NotImplementedError

    def build_norm(self) -> nn.Module:
        raise NotImplementedError

    def build_mtp(self) -> MultiTokenPrediction:
        """The multi-token prediction modules: module k (1..mtp_depth) runs the block a layer
        numbered n_layers + k - 1 would have (DeepSeek-V3's checkpoints number them so; a
        mixture of experts where the family's later layers have one)."""
        a = self.args
        blocks = [self.build_block(a.n_layers + k) for k in range(a.mtp_depth)]
        return MultiTokenPrediction(a.dim, blocks, self.build_norm, first=a.n_layers, loss_weight=a.mtp_loss_weight)

    def add_positions(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Learned position embeddings (GPT-2); identity for rotary families."""
        return h

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin for rotary families; None otherwise."""
        return None

    def init_rule(self, name: str) -> tuple:
        raise NotImplementedError

    # -- shared behaviour ------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: KVCache | None = None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, sequence: SequenceShards | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab) in the output layer's dtype, or with
        `labels` (B, T) the mean next-token loss (0-dim), which with fused cross-entropy
        never materializes the logits.

        A pipeline stage past the first receives hidden states (B, T, dim) as `tokens`.
        `positions` (T,) are the tokens' places in their sequence, 0..T-1 (after the cache)
        unless given: a rank holding a slice of the sequence (context parallelism) gives its own,
        and `sequence`, which makes the masks and mixes across the ranks' slices.
        """
        start = cache.length if cache is not None else 0
        if positions is None:
            T = document_ids.shape[1] if document_ids is not None else tokens.shape[1]
            positions = torch.arange(start, start + T, device=tokens.device)
        T = positions.shape[0]
        h = tokens
        if self.tok_embeddings is not None:
            h = self.add_positions(self.tok_embeddings(tokens), positions)  # (B, T, dim)
        kinds = {name: self.args.layer_type(int(name)) for name in self.layers}
        ropes = {kind: self.rope_tables_for(kind, positions) for kind in set(kinds.values())}
        masks = {kind: self.mask_for(kind, document_ids, T, start, tokens.device, sequence) for kind in ropes}
        # A pipeline stage past the first has hidden states, not token ids, to give its blocks.
        h = self.run_blocks(h, kinds, ropes, masks, cache, tokens=tokens if self.tok_embeddings is not None else None)
        if cache is not None:
            cache.advance(T)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if labels is None:
            return self.logits(h)
        loss = self.loss(h, labels)
        if self.mtp is not None and self.training:  # a training objective: validation reports the main loss
            kind = "full_attention"
            rope = ropes[kind] if kind in ropes else self.rope_tables_for(kind, positions)
            mask = masks[kind] if kind in masks else self.mask_for(kind, document_ids, T, start, tokens.device)
            loss = self.with_mtp(loss, h, tokens, labels, document_ids, rope, mask)
        return loss

    def with_mtp(self, loss: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                 document_ids: torch.Tensor | None, rope, mask) -> torch.Tensor:
        """The main `loss`, unchanged in value, with the multi-token prediction losses joined to
        its backward; `h` is what the first module reads, `tokens` the forward's input (the ids
        on a first stage, hidden states on a pipeline's later stage)."""
        # A pipeline's last stage has hidden states, not ids: t_{i+1} is labels[i], and only
        # positions past 0 are read; its embedding is the stage's copy.
        ids = tokens if self.tok_embeddings is not None else F.pad(labels[:, :-1].clamp(min=0), (1, 0))
        embed = self.tok_embeddings if self.tok_embeddings is not None else self.mtp.embed
        losses = self.mtp.losses(h, ids, labels, document_ids, embed=embed, head_loss=self.loss, rope=rope, mask=mask)
        return self.mtp.attach(loss, losses)

    def stage_widths(self) -> tuple[int, int]:
        """Widths of the hidden states this model, as a pipeline stage, receives and sends on:
        dim both; a family that sends more along (Gemma 4's per-layer inputs) says so."""
        return self.args.dim, self.args.dim

    def run_blocks(self, h: torch.Tensor, kinds: dict[str, str], ropes: dict, masks: dict,
                   cache: KVCache | None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states (B, T, dim) through this part's blocks in order, each with its kind's
        rotary tables and mask; `tokens` (B, T), the ids, for a family whose blocks read them
        (None on a pipeline stage past the first)."""
        for name, block in self.layers.items():
            h = block(h, ropes[kinds[name]], masks[kinds[name]], cache, int(name))
        return h

    def rope_tables_for(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of blocks of `kind`: the same for all unless a family uses
        another base for its local layers (Gemma 3)."""
        return self.rope_tables(positions) if kind in ATTENTION_TYPES else None

    def mask_for(self, kind: str, document_ids: torch.Tensor | None, T: int, start: int,
                 device: torch.device, sequence: SequenceShards | None = None) -> AttentionMask:
        """What blocks of `kind` may see, built once per forward: causal attention within each
        document (a sliding block the latest sliding_window positions of it), or for a
        linear-attention block the documents themselves, where its state starts afresh.
        With `sequence` (context parallelism) it makes the mask of the whole rows."""
        if sequence is not None:
            window = self.args.sliding_window if kind == "sliding_attention" else None
            return sequence.mask(kind, window=window, backend=self.args.attention,
                                 flex_causal=self.args.attention_sinks)
        if kind == "linear_attention":
            if document_ids is not None and start:
                raise ValueError("document_ids cannot be combined with a KV cache")
            return AttentionMask(document_ids=document_ids)
        window = self.args.sliding_window if kind == "sliding_attention" else None
        return build_mask(document_ids, q_len=T, kv_len=start + T, backend=self.args.attention,
                          window=window, device=device, flex_causal=self.args.attention_sinks)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection of final hidden states h (B, T, dim), times muP's output
        multiplier 1/mup_width_mult (on the logits, not the weight: a tied embedding stays
        as it is)."""
        out = self.output(h)
        mult = self.args.mup_width_mult
        return out if mult == 1.0 else out * (1.0 / mult)

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of final hidden states h (B, T, dim) against labels."""
        if "cross_entropy" in self.args.fused_ops:
            from forja.ops import fused_linear_cross_entropy

            mult = self.args.mup_width_mult  # (h / m) W^T = logits / m: muP's multiplier, fused
            h = h if mult == 1.0 else h * (1.0 / mult)
            # (B, T, dim) whole: flattening a sequence-parallel DTensor first would make a strided shard
            return fused_linear_cross_entropy(h, self.output.weight, labels)
        return next_token_loss(self.logits(h), labels)

    def init_weights(self, seed: int = 0) -> None:
        """Fill all parameters from `seed`, identically for any sharding or pipeline split
        (a stage's copy of the tied embedding is drawn as the embedding itself)."""
        ndims = {name: p.dim() for name, p in named_unique_parameters(self)}
        rule = mup_init_rule(self.init_rule, self.args.mup_width_mult, ndims)
        init_parameters(self, seed, rule, aliases=self.tied_parameters())
        for module in self.modules():  # state that is not a parameter (an MoE router's bias)
            if hasattr(module, "init_buffers"):
                module.init_buffers()

    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        a = self.args
        weight = self.tok_embeddings.weight
        attention = [i for i in range(a.n_layers) if a.layer_type(i) in ATTENTION_TYPES]
        return KVCache(a.n_layers, batch, max_len or a.max_seq_len, a.n_kv_heads, a.head_dim,
                       dtype=weight.dtype, device=weight.device, layers=attention)

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameters, each counted once (tied weights once). With `exclude_embeddings`,
        leaves out the lookup tables that do no matrix multiply: token embeddings when they
        are not tied to the output, and learned position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(p.numel() for p in self.lookup_tables())
        return n

    def num_active_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameters one token uses: a mixture of experts' routed experts count only for
        the share of them each token is sent to (top_k / n_experts)."""
        n = self.num_params(exclude_embeddings=exclude_embeddings)
        for module in self.modules():
            if isinstance(module, MoE):
                routed = sum(p.numel() for p in module.experts.parameters())
                n -= round(routed * (1 - module.active_fraction()))
        return n

    def lookup_tables(self) -> list[nn.Parameter]:
        tables = [] if self.args.tie_embeddings else [self.tok_embeddings.weight]
        return tables

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at `seq_len`.

        6 N for the weight matmuls (2 forward, 4 backward per parameter, Kaplan et al. 2020;
        N counts the parameters a token uses: a mixture of experts' active ones) plus
        12 L H hd T for the attention scores and weighted values (PaLM, Chowdhery et al. 2022,
        appendix B), counted over the full T x T square as the kernels that report MFU
        conventionally do, not the causal half. Multi-token prediction modules add their
        block's attention and one more pass through the output head each.
        """
        n = self.num_active_params(exclude_embeddings=True)
        mixing = sum(self.mixer_flops(self.args.layer_type(i), seq_len) for i in range(self.args.n_layers))
        # Each multi-token prediction module (counted in n) also runs the shared output head again.
        head = self.args.mtp_depth * 6 * self.args.vocab_size * self.args.dim
        mtp = self.args.mtp_depth * self.mixer_flops("full_attention", seq_len) + head
        return 6 * n + mixing + (mtp if self.mtp is not None else 0)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """Training FLOPs per token of one block's sequence mixing beyond its weight matmuls:
        12 H hd T for full attention, with T the keys a query sees (at most sliding_window
        in a sliding block). A family with linear-attention blocks counts those."""
        a = self.args
        if kind == "linear_attention":
            raise NotImplementedError(f"{type(self).__name__} does not count its linear-attention FLOPs")
        keys = seq_len if kind == "full_attention" else min(seq_len, a.sliding_window)
        return 12 * a.n_heads * a.head_dim * keys
