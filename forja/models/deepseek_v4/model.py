"""DeepSeek-V4 (DeepSeek-AI, 2026), single-device, as transformers 5.25's DeepseekV4ForCausalLM computes it.

- attention (forja/models/common/compressed_attention.py): shared-KV multi-query attention
  over a sliding window, with compressed entries of the whole past in "heavily compressed"
  (HCA) and "compressed sparse" (CSA: indexer-picked) blocks, per-head sinks, a grouped
  low-rank output projection; `layer_types` says which block is which;
- rotary positions on the last `rope_dim` channels of each head, interleaved pairs: base
  `rope_theta` in sliding blocks, `compress_rope_theta` (with `rope_scaling`, YaRN, its
  attention factor held at 1) in compressed ones and their compressors;
- every feed-forward a mixture of experts (forja/models/common/hash_moe.py): the first
  `n_hash_layers` route by a token-id table, the rest by top-k of sqrt-softplus scores;
- manifold-constrained hyper-connections (forja/models/common/hyper_connections.py): the
  residual is `hc_mult` streams, collapsed before and expanded after each sublayer, and
  collapsed once more before the final norm.

Multi-token prediction (`mtp_depth`, Hugging Face `num_nextn_predict_layers`; transformers
builds none, DeepSeek's release carries one module) as DeepSeek's own inference code runs it:
each depth keeps the `hc_mult` streams. It normalizes the incoming streams (hnorm, per stream)
and the next tokens' embeddings (enorm), adds e_proj(embedding) to every stream's h_proj, runs
one hyper-connected block with sliding-window attention (the release's module holds no
compressor) and a top-k routed mixture of experts, and hands its streams to the next depth;
the head reads them collapsed by the module's own hc_head and normalized by its own norm.
Training only (forja/models/common/mtp.py: targets, documents, the loss's route).

Parameter names: layers.{i}.{attn_hc, attention_norm, attention, ffn_hc, ffn_norm,
feed_forward}; attention.{wq_a, q_norm, wq_b, wkv, kv_norm, wo.wo_a, wo.wo_b, sinks,
compressor.*, indexer.*}; hc_head.{fn, base, scale}; mtp.layers.{n_layers + k - 1}.{e_proj,
h_proj, enorm, hnorm, norm, hc_head.*, block.*}.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache, SequenceShards, build_mask
from forja.models.common.blocks import BlockStructure
from forja.models.common.compressed_attention import V4_LAYER_TYPES, CompressedAttention
from forja.models.common.decoder import llama_weight_rule
from forja.models.common.hash_moe import ScoredMoE, ScoredMoEArgs
from forja.models.common.hyper_connections import HyperConnection, HyperHead
from forja.models.common.kv_compressor import DocumentWindows, half_rope_tables
from forja.models.common.mtp import MultiTokenPrediction
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import RopeScaling, YarnScaling, rope_frequencies, rope_scaling_from
from forja.models.common.transformer import Transformer, TransformerArgs

RESIDUAL_OUT = ("attention.wo.wo_b.weight", "experts.w2", "shared_experts.w2.weight")


@dataclass(kw_only=True)
class DeepSeekV4Args(TransformerArgs, ScoredMoEArgs):
    """A DeepSeek-V4 model's shape. `head_dim` is the one shared key/value head's width (also each
    query head's); `n_kv_heads` is 1; `ffn_dim` is one expert's width (= moe_ffn_dim)."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (Hugging Face `rms_norm_eps`)."""
    q_lora_rank: int = 1024
    """Width of the query latent."""
    rope_dim: int = 64
    """The last this-many channels of each head rotate (`qk_rope_head_dim`, head_dim x partial_rotary_factor)."""
    rope_theta: float = 10_000.0
    """Rotary base of sliding-window blocks."""
    compress_rope_theta: float = 160_000.0
    """Rotary base of compressed blocks and their compressed entries."""
    rope_scaling: YarnScaling | RopeScaling | None = None
    """YaRN scaling of the compressed blocks' rotary frequencies (cos/sin not rescaled); None: plain."""
    csa_ratio: int = 4
    """Tokens per compressed entry in compressed sparse attention blocks (stride; windows of twice that)."""
    hca_ratio: int = 128
    """Tokens per compressed entry in heavily compressed attention blocks."""
    o_groups: int = 8
    """Head groups of the grouped output projection."""
    o_lora_rank: int = 1024
    """Each group's projected width."""
    index_n_heads: int = 64
    """Lightning indexer heads (CSA blocks)."""
    index_head_dim: int = 128
    """Lightning indexer head width."""
    index_topk: int = 512
    """Compressed entries each query attends to in a CSA block."""
    hc_mult: int = 4
    """Residual streams of the hyper-connections."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations of the residual mixing."""
    hc_eps: float = 1e-6
    """Floor added in the hyper-connections' weights and Sinkhorn sums."""
    n_hash_layers: int = 3
    """The first this-many blocks route experts by token id (`mlp_layer_types` "hash_moe")."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="yarn")
        if isinstance(self.rope_scaling, YarnScaling) and self.rope_scaling.attention_factor != 1.0:
            if self.rope_scaling.attention_factor is not None:
                raise ForjaError(f"model.rope_scaling.attention_factor={self.rope_scaling.attention_factor}: "
                                 "DeepSeek-V4 keeps cos and sin unscaled; set it to 1.0")
            self.rope_scaling = dataclasses.replace(self.rope_scaling, attention_factor=1.0)
        if self.n_kv_heads not in (None, 1):
            raise ForjaError(f"model.n_kv_heads={self.n_kv_heads}: DeepSeek-V4 has one shared key/value head; "
                             "leave it unset")
        self.n_kv_heads = 1
        if self.head_dim is None or self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ForjaError(f"model.rope_dim={self.rope_dim} must be even and within head_dim={self.head_dim}")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ForjaError(f"model.o_groups={self.o_groups} must divide n_heads x head_dim = "
                             f"{self.n_heads * self.head_dim}")
        if min(self.csa_ratio, self.hca_ratio, self.hc_mult, self.hc_sinkhorn_iters, self.index_topk) < 1:
            raise ForjaError("model csa_ratio, hca_ratio, hc_mult, hc_sinkhorn_iters and index_topk must be >= 1")
        if not self.layer_types:
            self.layer_types = default_layer_types(self.n_layers)
        if self.moe_ffn_dim == 0:
            self.moe_ffn_dim = self.ffn_dim
        super().__post_init__()
        self.check_moe()

    @property
    def supported_layer_types(self) -> tuple[str, ...]:
        return V4_LAYER_TYPES

    def layout_limits(self) -> dict[str, str]:
        # Pipeline stages hand on the hc_mult streams and get the token ids (`DeepSeekV4.forward`);
        # context parallelism runs compressed attention on the rank's chunks
        # (forja/parallel/cp/compressed.py), whose windows are counted from the row's start.
        return {"cp_documents": "DeepSeek-V4's compressors split over ranks (they count windows from the row's "
                                "start)"}

    def split_counts(self) -> dict[str, int]:
        """Tensor parallelism splits the query heads and, with them, the output projection's
        groups (parallelize.py); the one key/value head, the indexer and the experts' width are
        not split (every feed-forward is a mixture of experts, split by tokens)."""
        return {"n_heads": self.n_heads, "o_groups": self.o_groups}

    def head_counts(self) -> dict[str, int]:
        """None handed out whole: all-to-all context parallelism keeps every query head on its
        rank (forja/parallel/cp/compressed.py), and tensor parallelism splits `split_counts`."""
        return {}

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def layer_type(self, layer: int) -> str:
        """Past the main layers (a multi-token prediction module's block): sliding-window only."""
        return "sliding_attention" if layer >= self.n_layers else super().layer_type(layer)

    def ratio(self, kind: str) -> int:
        return {"compressed_sparse_attention": self.csa_ratio, "heavily_compressed_attention": self.hca_ratio}.get(
            kind, 0)


def default_layer_types(n: int) -> tuple[str, ...]:
    """transformers' default schedule: two HCA blocks, then CSA and HCA alternating."""
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return tuple(["heavily_compressed_attention"] * min(n, 2) + rest)


class HyperConnectedBlock(nn.Module):
    """A pre-norm block over `hc_mult` streams (B, T, n, D): each sublayer reads the streams
    collapsed by its hyper-connection and its output is merged back (hyper_connections.py)."""

    placement = "pre"

    def __init__(self, attention: CompressedAttention, feed_forward: ScoredMoE, attention_norm: RMSNorm,
                 ffn_norm: RMSNorm, attn_hc: HyperConnection, ffn_hc: HyperConnection):
        super().__init__()
        self.attn_hc, self.attention_norm, self.attention = attn_hc, attention_norm, attention
        self.ffn_hc, self.ffn_norm, self.feed_forward = ffn_hc, ffn_norm, feed_forward
        self.structure = BlockStructure.of("pre", attention, feed_forward, attention_norm)

    def forward(self, x, rope, mask, cache: KVCache | None = None, layer: int = 0, token_ids=None):
        post, comb, h = self.attn_hc(x)  # h (B, T, D)
        x = HyperConnection.merge(x, self.attention(self.attention_norm(h), rope, mask, cache, layer), post, comb)
        post, comb, h = self.ffn_hc(x)
        return HyperConnection.merge(x, self.feed_forward(self.ffn_norm(h), token_ids), post, comb)


class HyperConnectedMTP(nn.Module):
    """One multi-token prediction depth over the streams: (previous streams (B, T, n, D),
    next-token embeddings (B, T, D)) -> streams (B, T, n, D); `head_input` collapses them."""

    def __init__(self, dim: int, block: HyperConnectedBlock, norm, *, hc_mult: int, eps: float, norm_eps: float):
        super().__init__()
        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.block = block
        self.hc_head = HyperHead(dim, hc_mult, eps=eps, norm_eps=norm_eps)

    def forward(self, streams: torch.Tensor, emb: torch.Tensor, rope, mask) -> torch.Tensor:
        x = self.e_proj(self.enorm(emb)).unsqueeze(2) + self.h_proj(self.hnorm(streams))  # (B, T, n, D)
        return self.block(x, rope, mask)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(streams))  # (B, T, D)


class DeepSeekV4(Transformer):
    args: DeepSeekV4Args
    # The streams' final collapse goes with the output norm (a pipeline's last stage), and the
    # hash-routed blocks read the token ids on whichever stage they are.
    output_side = (*Transformer.output_side, "hc_head")
    stages_read_tokens = True

    def __init__(self, args: DeepSeekV4Args):
        super().__init__(args)
        self.hc_head = HyperHead(args.dim, args.hc_mult, eps=args.hc_eps, norm_eps=args.norm_eps)

    def _inv_freq(self, compressed: bool) -> torch.Tensor:
        a = self.args
        with torch.device("cpu"):  # a plain tensor, also when the model is built on the meta device
            if compressed:
                return rope_frequencies(a.rope_dim, a.compress_rope_theta, a.rope_scaling)
            return rope_frequencies(a.rope_dim, a.rope_theta)

    def build_block(self, layer: int) -> HyperConnectedBlock:
        a = self.args
        kind = a.layer_type(layer)
        attention = CompressedAttention(
            a.dim, a.n_heads, a.head_dim, kind=kind, q_lora_rank=a.q_lora_rank, o_groups=a.o_groups,
            o_lora_rank=a.o_lora_rank, inv_freq=self._inv_freq(True), ratio=a.ratio(kind),
            index_n_heads=a.index_n_heads, index_head_dim=a.index_head_dim, index_topk=a.index_topk, eps=a.norm_eps)
        moe = ScoredMoE(a.dim, a, hashed=layer < a.n_hash_layers, vocab_size=a.vocab_size)
        hc = [HyperConnection(a.dim, a.hc_mult, sinkhorn_iters=a.hc_sinkhorn_iters, eps=a.hc_eps,
                              norm_eps=a.norm_eps) for _ in range(2)]
        return HyperConnectedBlock(attention, moe, self.build_norm(), self.build_norm(), *hc)

    def build_norm(self) -> RMSNorm:
        return RMSNorm(self.args.dim, self.args.norm_eps)

    def build_mtp(self) -> MultiTokenPrediction:
        a = self.args
        blocks = [self.build_block(a.n_layers + k) for k in range(a.mtp_depth)]
        module = functools.partial(HyperConnectedMTP, hc_mult=a.hc_mult, eps=a.hc_eps, norm_eps=a.norm_eps)
        return MultiTokenPrediction(a.dim, blocks, self.build_norm, first=a.n_layers, loss_weight=a.mtp_loss_weight,
                                    module=module)

    def rope_tables_for(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half tables (T, rope_dim / 2): interleaved RoPE, one angle per pair."""
        return half_rope_tables(self._inv_freq(kind != "sliding_attention"), positions)

    def mask_for(self, kind: str, document_ids: torch.Tensor | None, T: int, start: int,
                 device: torch.device, sequence: SequenceShards | None = None) -> AttentionMask:
        """One mask for every block: causal within the window and the document (the compressed
        entries' visibility is the attention's own, by `document_ids` too); with `sequence`
        (context parallelism) the whole rows' mixing."""
        if sequence is not None:
            return sequence.mask("compressed_attention", window=self.args.sliding_window, backend="sdpa",
                                 flex_causal=False)
        if document_ids is not None and bool((document_ids == document_ids[:, :1]).all()):
            document_ids = None  # one document a row: the compressors' plain windows
        mask = build_mask(document_ids, q_len=T, kv_len=start + T, window=self.args.sliding_window, device=device)
        if document_ids is not None:  # each compressor ratio's layout once, for every block
            ratios = {self.args.ratio(kind) for kind in self.args.layer_types} - {0}
            mask.windows = {r: DocumentWindows.of(document_ids, r) for r in ratios}
        return mask

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: KVCache | None = None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, sequence: SequenceShards | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), or with `labels` the mean next-token loss.

        A pipeline stage past the first receives the streams flattened, (B, T, hc_mult x dim),
        as `tokens`, and the ids (B, T) as `token_ids` for its hash-routed blocks; a stage
        before the last returns its streams so (`stage_widths`). Under context parallelism
        tokens are this rank's part of each row, at `positions` (T,), and `sequence` the rows'."""
        a = self.args
        ids = tokens if self.tok_embeddings is not None else token_ids  # (B, T), the hash layers' routing
        if ids is None and any(int(name) < a.n_hash_layers for name in self.layers):
            raise ForjaError("a DeepSeek-V4 pipeline stage with hash-routed blocks needs the token ids; "
                             "pass token_ids (forja's pipeline does: Transformer.stages_read_tokens)")
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        T = positions.shape[0]
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)  # (B, T, D)
            streams = h.unsqueeze(2).expand(-1, -1, a.hc_mult, -1).contiguous()  # (B, T, n, D)
        else:
            streams = tokens.unflatten(-1, (a.hc_mult, a.dim))  # (B, T, n D) from the stage before
        kinds = {name: a.layer_type(int(name)) for name in self.layers}
        ropes = {kind: self.rope_tables_for(kind, positions) for kind in set(kinds.values())}
        mask = self.mask_for("sliding_attention", document_ids, T, start, tokens.device, sequence)
        mask.positions = positions
        for name, block in self.layers.items():
            # the ids by keyword: a later stage's first block under SP takes (streams, rope, mask, cache, layer)
            streams = block(streams, ropes[kinds[name]], mask, cache, int(name), token_ids=ids)
        if cache is not None:
            cache.advance(T)
        if self.norm is None:  # a pipeline stage before the last hands on the streams
            return streams.flatten(2)  # (B, T, n D)
        h = self.norm(self.hc_head(streams))
        if labels is None:
            return self.logits(h)
        loss = self.loss(h, labels)
        if self.mtp is not None and self.training:  # its depths read the streams, not h
            kind = "sliding_attention"
            rope = ropes[kind] if kind in ropes else self.rope_tables_for(kind, positions)
            loss = self.with_mtp(loss, streams, tokens, labels, document_ids, rope, mask)
        return loss

    def stage_widths(self) -> tuple[int, int]:
        """A pipeline stage receives and sends the hc_mult streams, flattened: hc_mult x dim."""
        return self.args.hc_mult * self.args.dim, self.args.hc_mult * self.args.dim

    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        a = self.args
        weight = self.tok_embeddings.weight  # K = V: the values' buffer is one channel wide, unused
        return KVCache(a.n_layers, batch, max_len or a.max_seq_len, 1, a.head_dim, value_dim=1,
                       dtype=weight.dtype, device=weight.device)

    def init_rule(self, name: str) -> tuple:
        """Norms and the hyper-connections' gains at one; sinks, compressor position biases and
        hyper-connection biases at zero; residual writers shrink with depth; else std 0.02."""
        if name.endswith(("norm.weight", "_hc.scale", "hc_head.scale")):
            return ("ones",)
        if name.endswith(("sinks", "position_bias", "_hc.base", "hc_head.base")):
            return ("zeros",)
        return llama_weight_rule(self.args, name, RESIDUAL_OUT)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """12 H hd per key a query sees: the window, and the compressed entries (all of them
        in HCA, the indexer's top-k in CSA, whose indexer scores every entry: 6 h_I d_I each)."""
        a = self.args
        keys = min(seq_len, a.sliding_window)
        flops = 0
        if kind == "heavily_compressed_attention":
            keys += seq_len // a.hca_ratio
        elif kind == "compressed_sparse_attention":
            entries = seq_len // a.csa_ratio
            keys += min(a.index_topk, entries)
            flops += 6 * a.index_n_heads * a.index_head_dim * entries
        return flops + 12 * a.n_heads * a.head_dim * keys
