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

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.olmo_hybrid.model import OlmoHybridArgs, olmo_hybrid_layer_types
from forja.models.qwen3_5.hf import split_rows

ARCHITECTURES = ("OlmoHybridForCausalLM",)
IGNORED = (r"mtp\..*",)  # transformers ignores a multi-token prediction module too

_DEFAULT_THETA = 10_000.0  # transformers' rope default where config.json names no rope_theta
# The dolma2 tokenizer's ids, OlmoHybridConfig's defaults; written as null for a vocabulary too
# small to hold them (transformers refuses a padding row outside the embedding).
_TOKEN_IDS = (("pad_token_id", 100_277), ("eos_token_id", 100_257))


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's OLMo-Hybrid ({why})")


def _check_supported(cfg: dict) -> None:
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias", True, "OLMo-Hybrid's projections have no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "its MLPs and convolutions use 'silu'")
    if cfg.get("attention_dropout"):
        raise _refuse("attention_dropout", cfg["attention_dropout"], "forja trains without attention dropout; set 0.0")
    kinds = [t for t in cfg.get("layer_types") or [] if t not in ("full_attention", "linear_attention")]
    if kinds:
        raise _refuse("layer_types", kinds[0], "each block is 'full_attention' or 'linear_attention'")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _refuse("rope_parameters.rope_type", rope.get("rope_type", rope.get("type")), "plain RoPE or none")
    heads = cfg["num_attention_heads"]
    k_heads, v_heads = cfg.get("linear_num_key_heads") or heads, cfg.get("linear_num_value_heads") or heads
    if k_heads != v_heads:
        raise _refuse("linear_num_value_heads", v_heads, f"transformers' OLMo-Hybrid repeats no key heads: "
                      f"it must equal linear_num_key_heads={k_heads}")


def _rope_theta(cfg: dict) -> float | None:
    rope = cfg.get("rope_parameters") or {}
    theta = rope["rope_theta"] if "rope_theta" in rope else cfg.get("rope_theta", _DEFAULT_THETA)
    return None if theta is None else float(theta)


def args_from_config(cfg: dict) -> OlmoHybridArgs:
    _check_supported(cfg)
    dim, heads, n_layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    k_heads = cfg.get("linear_num_key_heads") or heads
    k_dim = cfg.get("linear_key_head_dim") or int(0.75 * dim / k_heads)
    return OlmoHybridArgs(
        dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or dim // heads, ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], max_seq_len=cfg.get("max_position_embeddings", 65_536),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(cfg),
        layer_types=tuple(cfg.get("layer_types") or olmo_hybrid_layer_types(n_layers)),
        linear_n_k_heads=k_heads, linear_n_v_heads=cfg.get("linear_num_value_heads") or heads,
        linear_k_head_dim=k_dim, linear_v_head_dim=cfg.get("linear_value_head_dim") or 2 * k_dim,
        linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        linear_allow_neg_eigval=bool(cfg.get("linear_allow_neg_eigval", True)),
        linear_a_log_min=cfg.get("linear_a_log_min", 0.0), linear_a_log_max=cfg.get("linear_a_log_max", 16.0),
        linear_dt_min=cfg.get("linear_dt_min", 0.001), linear_dt_max=cfg.get("linear_dt_max", 0.1),
        linear_dt_init_floor=cfg.get("linear_dt_init_floor", 1e-4),
    )


def _check_exportable(a: OlmoHybridArgs) -> None:
    """Refuse a forja OLMo-Hybrid that transformers' OlmoHybridForCausalLM cannot express."""
    problems = {
        "qk_norm": (not a.qk_norm, "transformers' OLMo-Hybrid always normalizes q and k"),
        "attention_sinks": (a.attention_sinks, "its attention has no sinks"),
        "sliding_window": (a.sliding_window is not None, "its attention blocks see the whole context"),
        "linear_n_v_heads": (a.linear_n_v_heads != a.linear_n_k_heads,
                             "its Gated DeltaNet repeats no key heads: as many value heads as key heads"),
        "mtp_depth": (a.mtp_depth > 0, "OLMo-Hybrid has no multi-token prediction"),
    }
    for field, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"an OLMo-Hybrid with {field}={getattr(a, field)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def config_from_args(a: OlmoHybridArgs) -> dict:
    _check_exportable(a)
    cfg = {
        "architectures": list(ARCHITECTURES), "model_type": "olmo_hybrid",
        "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.ffn_dim,
        "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
        "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "layer_types": [a.layer_type(i) for i in range(a.n_layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
        "linear_num_key_heads": a.linear_n_k_heads, "linear_num_value_heads": a.linear_n_v_heads,
        "linear_key_head_dim": a.linear_k_head_dim, "linear_value_head_dim": a.linear_v_head_dim,
        "linear_conv_kernel_dim": a.linear_conv_kernel, "linear_allow_neg_eigval": a.linear_allow_neg_eigval,
        "linear_a_log_min": a.linear_a_log_min, "linear_a_log_max": a.linear_a_log_max,
        "linear_dt_min": a.linear_dt_min, "linear_dt_max": a.linear_dt_max,
        "linear_dt_init_floor": a.linear_dt_init_floor,
    }
    cfg.update({key: None for key, token in _TOKEN_IDS if token >= a.vocab_size})
    return cfg


# -- tensors ---------------------------------------------------------------------------------
_MLP = (("mlp.gate_proj.weight", "feed_forward.w1.weight"), ("mlp.up_proj.weight", "feed_forward.w3.weight"),
        ("mlp.down_proj.weight", "feed_forward.w2.weight"))
_ATTENTION = (("self_attn.q_proj.weight", "attention.wq.weight"), ("self_attn.k_proj.weight", "attention.wk.weight"),
              ("self_attn.v_proj.weight", "attention.wv.weight"), ("self_attn.o_proj.weight", "attention.wo.weight"),
              ("self_attn.q_norm.weight", "attention.q_norm.weight"),
              ("self_attn.k_norm.weight", "attention.k_norm.weight"),
              ("feedforward_layer_norm.weight", "post_attention_norm.weight"),
              ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"))
_LINEAR = (("linear_attn.q_proj.weight", "attention.wq.weight"), ("linear_attn.k_proj.weight", "attention.wk.weight"),
           ("linear_attn.v_proj.weight", "attention.wv.weight"), ("linear_attn.g_proj.weight", "attention.wz.weight"),
           ("linear_attn.b_proj.weight", "attention.wb.weight"), ("linear_attn.a_proj.weight", "attention.wa.weight"),
           ("linear_attn.o_proj.weight", "attention.wo.weight"), ("linear_attn.A_log", "attention.A_log"),
           ("linear_attn.dt_bias", "attention.dt_bias"), ("linear_attn.o_norm.weight", "attention.norm.weight"),
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
    out = [TensorRule(hf + h, (ours + f,)) for h, f in _MLP]
    if a.layer_type(i) != "linear_attention":
        return out + [TensorRule(hf + h, (ours + f,)) for h, f in _ATTENTION]
    out += [TensorRule(hf + h, (ours + f,)) for h, f in _LINEAR]
    key, value = a.linear_n_k_heads * a.linear_k_head_dim, a.linear_n_v_heads * a.linear_v_head_dim
    convs = tuple(ours + f"attention.{f}.weight" for _, f in _CONVS)
    if conv == "fused":
        to_forja, to_hf = split_rows([key, key, value])
        return out + [TensorRule(hf + "linear_attn.conv1d.weight", convs, to_forja=to_forja, to_hf=to_hf)]
    total = 2 * key + value
    third = -(-total // 3)  # torch.chunk's: the last piece takes what is left
    cuts = [key, key, value] if conv == "split" else [third, third, total - 2 * third]
    return out + conv_rules(hf, convs, [key, key, value], cuts)


def model_rules(a: OlmoHybridArgs, conv: str) -> list[TensorRule]:
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    for i in range(a.n_layers):
        out += layer_rules(a, i, conv)
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


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
