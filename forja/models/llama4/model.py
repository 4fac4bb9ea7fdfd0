"""Llama 4's text model (Meta, "The Llama 4 herd", April 2025: Scout 17B-16E, Maverick
17B-128E), single-device.

A pre-norm RMSNorm decoder (eps 1e-5) with grouped-query attention and, in some blocks, a
mixture of experts; what is its own ("iRoPE" and its experts):

- NoPE layers: every `nope_interval`-th block (Hugging Face `no_rope_layers`, a 0 there)
  turns no rotary positions and attends over the whole row; its queries are multiplied by
  1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) at position p (attention
  temperature tuning, after Nakanishi 2025, arXiv 2501.19399), which needs the positions
  on the mask (`AttentionMask.positions`);
- the rotary layers attend in chunks (`attention_chunk_size`): the row is cut into chunks of
  that many positions and a token sees only earlier tokens of its own chunk (a mask kind,
  "chunked_attention", which composes with packed documents like a sliding window);
- QK-norm on the rotary layers only: each head's query and key divided by their RMS, no
  weight, after RoPE (`use_qk_norm`; Maverick has none);
- RoPE over complex pairs (x[2i], x[2i+1]) in transformers; forja turns (x[i], x[i + d/2]),
  so wq/wk rows are permuted within each head at load and back at save (hf.py), exact both
  ways; Llama 3's frequency scaling as the config says (Scout: factor 16 over 8,192);
- the mixture of experts (`moe_layers`): a router whose top_k logits go through a sigmoid,
  unnormalized; each chosen expert's INPUT is scaled by its weight (expert(w x), not
  w expert(x): `MoEArgs.scale_expert_input`), plus a shared SwiGLU expert every token takes
  (`intermediate_size` wide, like the routed ones). Dense blocks are SwiGLUs
  `intermediate_size_mlp` wide (`ffn_dim` here).

Parameter names follow the dense TP plan (common/tp_plan.py): attention.wq/wk/wv/wo,
feed_forward.w1/w2/w3 (dense) or feed_forward.router.gate, experts.w1/w3 (E, H, D),
experts.w2 (E, D, H), shared_experts.w1/w2/w3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from forja.errors import ForjaError
from forja.models.common.attention import Attention, AttentionMask, KVCache, SequenceShards, build_mask
from forja.models.common.decoder import RotaryDecoder
from forja.models.common.moe import MoEArgs
from forja.models.common.rope import LinearScaling, RopeScaling, YarnScaling, rope_scaling_from
from forja.models.common.transformer import TransformerArgs

LAYER_TYPES = ("full_attention", "chunked_attention")
"""The kinds of block Llama 4 builds: attention over the whole row, or within chunks."""


def default_nope_layers(n_layers: int, interval: int) -> tuple[int, ...]:
    """transformers' default NoPE layers: every `interval`-th block, the last of each group."""
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def default_moe_layers(n_layers: int, step: int) -> tuple[int, ...]:
    """transformers' default MoE layers: every `step`-th block, the last of each group."""
    return tuple(range(step - 1, n_layers, step))


def default_layer_types(n_layers: int, nope: tuple[int, ...], chunk: int | None) -> tuple[str, ...]:
    """transformers' default: the rotary blocks chunked (when a chunk size is set), the NoPE ones full."""
    return tuple("chunked_attention" if i not in nope and chunk is not None else "full_attention"
                 for i in range(n_layers))


@dataclass(kw_only=True)
class Llama4Args(TransformerArgs, MoEArgs):
    """A Llama 4 text model's shape; the package's FLAVORS hold the published sizes. `ffn_dim`
    is the dense blocks' SwiGLU width (Hugging Face `intermediate_size_mlp`), `moe_ffn_dim`
    each expert's and the shared expert's (`intermediate_size`)."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm and of the QK-norm (Hugging Face `rms_norm_eps`)."""
    rope_theta: float = 500_000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | YarnScaling | LinearScaling | None = None
    """Frequency scaling (Llama 3's for Scout; a table from TOML); None: plain RoPE."""
    attention_bias: bool = False
    """Biases on the q, k, v and o projections (`attention_bias`)."""
    attention_chunk_size: int | None = 8192
    """Positions of one chunk of a chunked_attention block (None: no chunked blocks by default)."""
    nope_interval: int = 4
    """Every this many blocks one skips RoPE (`no_rope_layer_interval`), when nope_layers is None."""
    nope_layers: tuple[int, ...] | None = None
    """The blocks without RoPE (the 0s of `no_rope_layers`); None: every nope_interval-th."""
    use_qk_norm: bool = True
    """RMS-normalize each head's queries and keys, without weights, after RoPE on rotary blocks."""
    attn_temperature_tuning: bool = True
    """Scale a NoPE block's queries by their position's temperature (`floor_scale`, `attn_scale`)."""
    floor_scale: int = 8192
    """Positions per step of the temperature's logarithm."""
    attn_scale: float = 0.1
    """Strength of the temperature: 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale))."""
    moe_step: int = 1
    """Every this many blocks one has the mixture of experts (`interleave_moe_layer_step`),
    when moe_layers is None."""
    moe_layers: tuple[int, ...] | None = None
    """The blocks with a mixture of experts (`moe_layers`); None: every moe_step-th."""
    ffn_dim: int = 16384
    n_experts: int = 16
    """Routed experts per MoE block (`num_local_experts`)."""
    moe_ffn_dim: int = 8192
    """One expert's hidden width, the shared expert's too (`intermediate_size`)."""
    n_shared_experts: int = 1
    """The shared expert every token goes through (Llama 4 has one)."""
    score_func: Literal["softmax", "sigmoid", "topk_softmax"] = "sigmoid"
    """A sigmoid of each chosen logit."""
    norm_topk_prob: bool = False
    """The chosen weights are not renormalized."""
    scale_expert_input: bool = True
    """An expert's input, not its output, is scaled by its weight."""

    def __post_init__(self) -> None:
        self.rope_scaling = rope_scaling_from(self.rope_scaling, key="model.overrides.rope_scaling", default="llama3")
        for name, step in (("nope_interval", self.nope_interval), ("moe_step", self.moe_step)):
            if step < 1:
                raise ForjaError(f"model {name} = {step} must be at least 1; set it in model.overrides")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ForjaError(f"model attention_chunk_size = {self.attention_chunk_size} must be at least 1 "
                             "(or None for no chunked blocks)")
        if self.nope_layers is None:
            self.nope_layers = default_nope_layers(self.n_layers, self.nope_interval)
        if self.moe_layers is None:
            self.moe_layers = default_moe_layers(self.n_layers, self.moe_step)
        self.nope_layers, self.moe_layers = tuple(self.nope_layers), tuple(self.moe_layers)
        if not self.layer_types:
            self.layer_types = default_layer_types(self.n_layers, self.nope_layers, self.attention_chunk_size)
        super().__post_init__()
        if "chunked_attention" in self.layer_types and self.attention_chunk_size is None:
            raise ForjaError("model.layer_types has chunked_attention blocks but model attention_chunk_size is "
                             "None; set the chunk (in tokens)")
        self.check_moe()

    @property
    def supported_layer_types(self) -> tuple[str, ...]:
        return LAYER_TYPES

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if layer < self.n_layers else "full_attention"

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer in self.moe_layers

    def is_nope_layer(self, layer: int) -> bool:
        """Whether block `layer` turns no rotary positions."""
        return layer in self.nope_layers


class Llama4(RotaryDecoder):
    args: Llama4Args

    def __init__(self, args: Llama4Args):
        super().__init__(args)
        self._positions: torch.Tensor | None = None  # this forward's positions, for the masks (`mask_for`)

    def build_attention(self, layer: int) -> Attention:
        a = self.args
        nope = a.is_nope_layer(layer)
        temperature = (a.floor_scale, a.attn_scale) if nope and a.attn_temperature_tuning else None
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, bias=a.attention_bias, qk_norm=a.qk_norm,
                         norm_eps=a.norm_eps, fused_rope="rope" in a.fused_ops, sinks=a.attention_sinks,
                         rotary=not nope, unit_qk=a.use_qk_norm and not nope, temperature=temperature)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: KVCache | None = None, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, sequence: SequenceShards | None = None) -> torch.Tensor:
        """`Transformer.forward`, the positions kept for the NoPE blocks' temperature (`mask_for`)."""
        self._positions = positions
        try:
            return super().forward(tokens, document_ids, cache=cache, positions=positions, labels=labels,
                                   sequence=sequence)
        finally:
            self._positions = None

    def rope_tables_for(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's kind is attention; a NoPE block ignores the tables."""
        return self.rope_tables(positions)

    def mask_for(self, kind: str, document_ids: torch.Tensor | None, T: int, start: int,
                 device: torch.device, sequence: SequenceShards | None = None) -> AttentionMask:
        """Causal attention within each document, within each chunk for a chunked block; with the
        queries' positions when a NoPE block tunes its temperature."""
        a = self.args
        if kind == "chunked_attention" and sequence is not None:  # context parallel: chunks as documents
            mask = super().mask_for("full_attention", document_ids, T, start, device,
                                    sequence.within_chunks(a.attention_chunk_size))
        elif kind == "chunked_attention":
            mask = build_mask(document_ids, q_len=T, kv_len=start + T, backend=a.attention, device=device,
                              chunk=a.attention_chunk_size)
        else:
            mask = super().mask_for(kind, document_ids, T, start, device, sequence)
        if a.attn_temperature_tuning and a.nope_layers:
            given = self._positions
            mask.positions = given if given is not None else torch.arange(start, start + T, device=device)
        return mask

    def new_kv_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        a, weight = self.args, self.tok_embeddings.weight
        return KVCache(a.n_layers, batch, max_len or a.max_seq_len, a.n_kv_heads, a.head_dim,
                       dtype=weight.dtype, device=weight.device)

    def mixer_flops(self, kind: str, seq_len: int) -> int:
        """12 H hd x the keys a query sees: the whole row, or at most a chunk (the full
        square's convention, `Transformer.flops_per_token`: T x chunk per chunked block)."""
        a = self.args
        if kind == "chunked_attention":
            return 12 * a.n_heads * a.head_dim * min(seq_len, a.attention_chunk_size)
        return super().mixer_flops(kind, seq_len)

    def init_rule(self, name: str) -> tuple:
        """Llama's rule (`RotaryDecoder.init_rule`), attention biases starting at zero."""
        if name.endswith(".bias"):
            return ("zeros",)
        return super().init_rule(name)
