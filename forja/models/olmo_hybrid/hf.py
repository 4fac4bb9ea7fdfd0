"""Hugging Face `OlmoHybridForCausalLM` <-> forja OLMo-Hybrid.

Read as transformers 5.24's OlmoHybridConfig reads config.json, its defaults where a key
is absent (Gated DeltaNet heads: the attention heads; key heads 0.75 hidden / heads wide,
value heads twice that; every fourth block attention). Positions: `rope_theta` null, in
`rope_parameters` or at the top level, is NoPE (the released checkpoints); absent, RoPE
with base 10,000.

Tensor names: transformers 5.24 loads OLMo-Hybrid checkpoints through a renaming
(conversion_mapping.py) and writes them back through its inverse, so a checkpoint may name
a norm either way: `attention_layer_norm` or `input_layernorm`, `feedforward_layer_norm` or
`post_attention_layernorm`, in every block alike. forja reads both (`normalize_name` takes
the module names to the on-disk ones) and writes the on-disk ones, as save_pretrained does:

- a Gated DeltaNet block's attention_layer_norm / feedforward_layer_norm are its pre-norms
  (attention_norm, ffn_norm); an attention block's feedforward_layer_norm is the norm after
  its attention (OLMo 3's post-norm, post_attention_norm), post_feedforward_layernorm the
  one after its MLP (post_ffn_norm);
- the convolutions, one over q | k | v channels in transformers' module, stored three ways:
  `linear_attn.q_conv1d`, `k_conv1d`, `v_conv1d` cut at the projections' widths, as forja
  keeps them (conv_q, conv_k, conv_v; shardable by head) and writes them; the same three
  names cut in thirds (torch.chunk), as transformers 5.24's save_pretrained writes them (its
  inverse of the load-time concatenation is an equal chunk: its "q_conv1d" then holds
  key channels too, where the value heads are wider than the key heads); or one
  `linear_attn.conv1d` (save_original_format=False). Loading follows the one whose names
  and shapes the checkpoint holds (forja/models/hf.py);
- `linear_attn.g_proj` is the output gate, forja's wz.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.olmo_hybrid.model import OlmoHybridArgs, olmo_hybrid_layer_types

ARCHITECTURES = ("OlmoHybridForCausalLM",)
IGNORED = (r"mtp\..*",)  # transformers ignores a multi-token prediction module too

_DEFAULT_THETA = 10_000.0  # transformers' rope default where config.json names no rope_theta
# The dolma2 tokenizer's ids, OlmoHybridConfig's defaults; written as null for a vocabulary too
# small to hold them (transformers refuses a padding row outside the embedding).
_TOKEN_IDS = (("pad_token_id", 100_277), ("eos_token_id", 100_257))
_refuse = hf_rules.refusal("OLMo-Hybrid")
_SUPPORTED = [hf_rules.no_attention_bias("OLMo-Hybrid's projections have no biases"),
              hf_rules.activation("silu", "its MLPs and convolutions use 'silu'"), hf_rules.NO_ATTENTION_DROPOUT]
# The Gated DeltaNet's initialization ranges: args field -> (config.json key, OlmoHybridConfig's default).
_INIT_RANGES = {"linear_a_log_min": ("linear_a_log_min", 0.0), "linear_a_log_max": ("linear_a_log_max", 16.0),
                "linear_dt_min": ("linear_dt_min", 0.001), "linear_dt_max": ("linear_dt_max", 0.1),
                "linear_dt_init_floor": ("linear_dt_init_floor", 1e-4)}


def _check_supported(cfg: dict) -> None:
    hf_rules.check_config(cfg, _SUPPORTED, _refuse)
    hf_rules.check_linear_layer_types(cfg, _refuse)
    hf_rules.check_rope_types(cfg, _refuse)


def _rope_theta(cfg: dict) -> float | None:
    rope = cfg.get("rope_parameters") or {}
    theta = rope["rope_theta"] if "rope_theta" in rope else cfg.get("rope_theta", _DEFAULT_THETA)
    return None if theta is None else float(theta)


def args_from_config(cfg: dict) -> OlmoHybridArgs:
    _check_supported(cfg)
    args = hf_rules.decoder_args(cfg, max_position_embeddings=65_536)
    heads = args["n_heads"]
    # OlmoHybridConfig's Gated DeltaNet: the attention's heads; keys 0.75 dim / heads wide, values twice that.
    k_heads = cfg.get("linear_num_key_heads") or heads
    k_dim = cfg.get("linear_key_head_dim") or int(0.75 * args["dim"] / k_heads)
    linear = hf_rules.linear_attention_args(cfg, linear_num_key_heads=heads, linear_num_value_heads=heads,
                                   linear_key_head_dim=k_dim, linear_value_head_dim=2 * k_dim)
    theta = _rope_theta(cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    return OlmoHybridArgs(
        **args, **linear, rope_theta=theta,
        rope_scaling=None if theta is None else rope_scaling_from_hf(rope, args["max_seq_len"]),
        layer_types=tuple(cfg.get("layer_types") or olmo_hybrid_layer_types(args["n_layers"])),
        linear_allow_neg_eigval=bool(cfg.get("linear_allow_neg_eigval", True)),
        **{field: cfg.get(key, default) for field, (key, default) in _INIT_RANGES.items()},
    )


def config_from_args(a: OlmoHybridArgs) -> dict:
    hf_rules.check_exportable(a, "an OLMo-Hybrid", {
        "qk_norm": (not a.qk_norm, "transformers' OLMo-Hybrid always normalizes q and k"),
        "attention_sinks": (a.attention_sinks, "its attention has no sinks"),
        "sliding_window": (a.sliding_window is not None, "its attention blocks see the whole context"),
        "mtp_depth": (a.mtp_depth > 0, "OLMo-Hybrid has no multi-token prediction"),
    })
    cfg = {"architectures": list(ARCHITECTURES), "model_type": "olmo_hybrid", **hf_rules.decoder_config(a),
           "hidden_act": "silu", "attention_bias": False, **hf_rules.linear_attention_config(a),
           "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                               **(rope_scaling_to_hf(a.rope_scaling) if a.rope_scaling else {})},
           "linear_allow_neg_eigval": a.linear_allow_neg_eigval,
           **{key: getattr(a, field) for field, (key, _) in _INIT_RANGES.items()}}
    cfg.update({key: None for key, token in _TOKEN_IDS if token >= a.vocab_size})
    return cfg


# -- tensors ---------------------------------------------------------------------------------
_ATTENTION = (*hf_rules.attention_pairs(qk_norm=True), ("feedforward_layer_norm.weight", "post_attention_norm.weight"),
              ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"))
_LINEAR = (*((f"linear_attn.{p}_proj.weight", f"attention.w{f}.weight") for p, f in
             (("q", "q"), ("k", "k"), ("v", "v"), ("g", "z"), ("b", "b"), ("a", "a"), ("o", "o"))),
           ("linear_attn.A_log", "attention.A_log"), ("linear_attn.dt_bias", "attention.dt_bias"),
           ("linear_attn.o_norm.weight", "attention.norm.weight"),
           ("attention_layer_norm.weight", "attention_norm.weight"),
           ("feedforward_layer_norm.weight", "ffn_norm.weight"))
_CONVS = (("q_conv1d", "conv_q"), ("k_conv1d", "conv_k"), ("v_conv1d", "conv_v"))


@dataclass(frozen=True)
class ChannelRange(TensorRule):
    """A stored tensor holding channels [start, end) (dim 0) of the forja tensors laid end
    to end, whichever of them that range overlaps."""

    start: int = 0
    end: int = 0

    def forja_views(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        views, offset = [], 0
        for name in self.forja:
            t = tensors[name]
            lo, hi = max(self.start, offset), min(self.end, offset + t.shape[0])
            if lo < hi:
                views.append(t[lo - offset:hi - offset])
            offset += t.shape[0]
        return tuple(views)


def conv_rules(hf: str, convs: tuple[str, ...], sizes: list[int], cuts: list[int]) -> list[TensorRule]:
    """The stored convolutions q_conv1d, k_conv1d, v_conv1d, `cuts` channels each, over forja's
    `convs` of `sizes` channels."""
    out, start = [], 0
    for (name, _), width in zip(_CONVS, cuts, strict=True):
        ends = [e for e in _running(sizes) if start < e < start + width]  # forja boundaries inside the range
        pieces = [b - a for a, b in zip([start, *ends], [*ends, start + width])]
        out.append(ChannelRange(hf + f"linear_attn.{name}.weight", convs, start=start, end=start + width,
                                to_forja=lambda t, p=pieces: tuple(x.contiguous() for x in t.split(p, dim=0)),
                                to_hf=lambda ts: torch.cat(ts, dim=0)))
        start += width
    return out


def _running(sizes: list[int]) -> list[int]:
    total, out = 0, []
    for n in sizes:
        total += n
        out.append(total)
    return out


def layer_rules(a: OlmoHybridArgs, i: int, conv: str) -> list[TensorRule]:
    """Layer i's rules, its convolutions stored `conv`: "split" (at the projections' widths),
    "thirds" (transformers' save_pretrained) or "fused" (one conv1d)."""
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    out = hf_rules.renamed(hf_rules.MLP_PAIRS, hf, ours)
    if a.layer_type(i) != "linear_attention":
        return out + hf_rules.renamed(_ATTENTION, hf, ours)
    out += hf_rules.renamed(_LINEAR, hf, ours)
    key, value = a.linear_n_k_heads * a.linear_k_head_dim, a.linear_n_v_heads * a.linear_v_head_dim
    convs = tuple(ours + f"attention.{f}.weight" for _, f in _CONVS)
    if conv == "fused":
        to_forja, to_hf = hf_rules.split_rows([key, key, value])
        return out + [TensorRule(hf + "linear_attn.conv1d.weight", convs, to_forja=to_forja, to_hf=to_hf)]
    total = 2 * key + value
    third = -(-total // 3)  # torch.chunk's: the last piece takes what is left
    cuts = [key, key, value] if conv == "split" else [third, third, total - 2 * third]
    return out + conv_rules(hf, convs, [key, key, value], cuts)


def model_rules(a: OlmoHybridArgs, conv: str) -> list[TensorRule]:
    return hf_rules.decoder_rules(a, lambda i: layer_rules(a, i, conv))


def rules(a: OlmoHybridArgs) -> list[TensorRule]:
    """One convolution per projection, at its width: forja's own layout, the one it writes."""
    return model_rules(a, "split")


def other_layouts(a: OlmoHybridArgs) -> list[list[TensorRule]]:
    """transformers' save_pretrained's (the convolutions in thirds) and its module layout
    (one convolution over q | k | v)."""
    return [model_rules(a, "thirds"), model_rules(a, "fused")]


def normalize_name(name: str) -> str:
    """transformers' module names for the norms as the on-disk ones (the inverse of its
    load-time renaming, applied to every block as it applies it)."""
    name = re.sub(r"\.input_layernorm\.", ".attention_layer_norm.", name)
    return re.sub(r"\.post_attention_layernorm\.", ".feedforward_layer_norm.", name)


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED,
                    normalize_name=normalize_name, other_layouts=other_layouts)
