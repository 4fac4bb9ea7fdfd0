"""Hugging Face `Llama4ForCausalLM` (config `Llama4TextConfig`, model_type "llama4_text") <->
forja Llama 4.

Only the text model is a forja family: a multimodal checkpoint (`Llama4ForConditionalGeneration`,
model_type "llama4" with a `text_config` and a vision tower) is refused, as is a quantized one.
Absent keys take Llama4TextConfig's defaults, which are Scout's: no_rope_layers from
no_rope_layer_interval (4), moe_layers from interleave_moe_layer_step (1), layer_types chunked on
the rotary blocks when attention_chunk_size is set. Reads both rope dialects (4.x `rope_theta` +
`rope_scaling`, as released; 5.x `rope_parameters`); writes 4.x.

Tensors (transformers 5 keeps the module names; no conversion on save):
- `self_attn.{q,k}_proj.{weight,bias}`: rows of each head in transformers' complex-pair order
  (x[2i], x[2i+1] one pair) -> forja's rotate-half order (x[i], x[i + d/2]); the permutation is
  applied on every block (a NoPE block's q.k is the same under it) and undone on save, bit-exact;
- `self_attn.{v,o}_proj.{weight,bias}` -> attention.w{v,o} as they are;
- dense blocks: `feed_forward.{gate,up,down}_proj.weight` -> feed_forward.w1/w3/w2;
- MoE blocks: `feed_forward.router.weight` -> feed_forward.router.gate.weight;
  `feed_forward.experts.gate_up_proj` (E, D, 2H), stored for x @ W with the gate's columns
  first, then the up's -> experts.w1, w3 (E, H, D); `feed_forward.experts.down_proj` (E, H, D)
  -> experts.w2 (E, D, H); `feed_forward.shared_expert.{gate,up,down}_proj.weight` ->
  feed_forward.shared_experts.w1/w3/w2.

Read by nothing: `router_jitter_noise` (transformers' Llama 4 does not read it),
`output_router_logits` / `router_aux_loss_coef` (a training loss; forja's `aux_loss_weight` is
the run's), `pad_token_id` (an embedding row whose gradient transformers zeroes; forja trains
it), `for_llm_compressor`, `cache_implementation`. `attn_temperature_tuning` is read as a
truth value (the released configs write 4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.llama4.model import LAYER_TYPES, Llama4Args, default_layer_types, default_moe_layers

ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")  # the second only to be refused
IGNORED: tuple[str, ...] = ()

_refuse = hf_rules.refusal("Llama 4")
_CHECKS = (hf_rules.activation("silu", "Llama 4's feed-forwards are SwiGLUs"), hf_rules.NO_ATTENTION_DROPOUT)


def _refuse_what_forja_lacks(cfg: dict) -> None:
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") == "llama4" or "text_config" in cfg or "Llama4ForConditionalGeneration" in archs:
        raise _refuse("architectures", archs, "only the text model, Llama4ForCausalLM, is a forja family; forja "
                      "has no vision encoder: save the language model alone as a Llama4ForCausalLM")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method, "forja loads the bf16/fp32 layout; dequantize "
                      "the checkpoint first")
    hf_rules.check_config(cfg, _CHECKS, _refuse)
    hf_rules.check_rope_types(cfg, _refuse)
    kinds = [t for t in cfg.get("layer_types") or [] if t not in LAYER_TYPES]
    if kinds:
        raise _refuse("layer_types", kinds[0], "each block is 'full_attention' or 'chunked_attention'")


def _heads(cfg: dict) -> tuple[int, int, int]:
    """(query heads, key/value heads, head width) as Llama4TextConfig resolves them: an absent key
    takes the class default, a null one n_heads (key/value heads) or dim // n_heads (width)."""
    dim, heads = cfg.get("hidden_size") or 5120, cfg.get("num_attention_heads") or 40
    kv = cfg.get("num_key_value_heads", 8)
    head_dim = cfg.get("head_dim", 128)
    return heads, kv if kv is not None else heads, head_dim if head_dim is not None else dim // heads


def args_from_config(cfg: dict) -> Llama4Args:
    _refuse_what_forja_lacks(cfg)
    args = hf_rules.decoder_args(cfg, hidden_size=5120, num_attention_heads=40, vocab_size=202_048,
                                 max_position_embeddings=131_072, rms_norm_eps=1e-5)
    n_layers = args["n_layers"]
    args["n_heads"], args["n_kv_heads"], args["head_dim"] = _heads(cfg)
    args["ffn_dim"] = cfg.get("intermediate_size_mlp") or 16384
    rope_flags = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0)
                                                for i in range(n_layers)]
    nope = tuple(i for i, flag in enumerate(rope_flags[:n_layers]) if not flag)
    step = cfg.get("interleave_moe_layer_step", 1)
    moe = cfg.get("moe_layers")
    moe = default_moe_layers(n_layers, step) if moe is None else tuple(i for i in moe if i < n_layers)
    chunk = cfg.get("attention_chunk_size", 8192)
    return Llama4Args(
        **args, **hf_rules.rope_args(cfg, args["max_seq_len"], 500_000.0),
        attention_bias=bool(cfg.get("attention_bias", False)), attention_chunk_size=chunk,
        nope_interval=cfg.get("no_rope_layer_interval", 4), nope_layers=nope,
        use_qk_norm=bool(cfg.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
        floor_scale=cfg.get("floor_scale", 8192), attn_scale=float(cfg.get("attn_scale", 0.1)),
        moe_step=step, moe_layers=moe, n_experts=cfg.get("num_local_experts", 16),
        top_k=cfg.get("num_experts_per_tok", 1), moe_ffn_dim=cfg.get("intermediate_size") or 8192,
        layer_types=tuple(cfg.get("layer_types") or default_layer_types(n_layers, nope, chunk)),
    )


def config_from_args(a: Llama4Args) -> dict:
    hf_rules.check_exportable(a, "a Llama 4", {
        "qk_norm": (a.qk_norm, "Llama 4's QK-norm has no weights: use use_qk_norm"),
        "sliding_window": (a.sliding_window is not None, "Llama 4 attends in chunks, not sliding windows"),
        "attention_sinks": (a.attention_sinks, "Llama 4's attention has no sinks"),
        "score_func": (a.score_func != "sigmoid", "Llama 4's router takes a sigmoid of the chosen logits"),
        "norm_topk_prob": (a.norm_topk_prob, "Llama 4 does not renormalize the chosen weights"),
        "route_scale": (a.route_scale != 1.0, "Llama 4 does not scale routing weights"),
        "n_expert_groups": (a.n_expert_groups > 1, "Llama 4 routes over all experts at once"),
        "expert_bias": (a.expert_bias, "Llama 4's router has no balancing bias"),
        "router_bias": (a.router_bias, "Llama 4's router has no bias"),
        "expert_proj_bias": (a.expert_proj_bias, "Llama 4's experts have no biases"),
        "expert_activation": (a.expert_activation != "swiglu", "Llama 4's experts are SwiGLUs"),
        "scale_expert_input": (not a.scale_expert_input, "Llama 4 scales each expert's input by its weight"),
        "n_shared_experts": (a.n_shared_experts != 1 or a.shared_width != a.moe_ffn_dim,
                             "Llama 4 has one shared expert as wide as a routed one"),
        "shared_expert_gate": (a.shared_expert_gate, "Llama 4's shared expert has no gate"),
        "n_experts": (a.n_experts < 1, "every Llama 4 has routed experts (moe_layers may be empty)"),
        "capacity_factor": (a.capacity_factor > 0, "Llama 4 drops no tokens"),
        "mtp_depth": (a.mtp_depth > 0, "Llama 4 has no multi-token prediction"),
    })
    return {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", **hf_rules.decoder_config(a),
            "intermediate_size": a.moe_ffn_dim, "intermediate_size_mlp": a.ffn_dim, "hidden_act": "silu",
            "attention_bias": a.attention_bias, "attention_chunk_size": a.attention_chunk_size,
            "no_rope_layers": [int(not a.is_nope_layer(i)) for i in range(a.n_layers)],
            "no_rope_layer_interval": a.nope_interval, "use_qk_norm": a.use_qk_norm,
            "attn_temperature_tuning": a.attn_temperature_tuning, "floor_scale": a.floor_scale,
            "attn_scale": a.attn_scale, "layer_types": [a.layer_type(i) for i in range(a.n_layers)],
            "num_local_experts": a.n_experts, "num_experts_per_tok": a.top_k, "moe_layers": list(a.moe_layers),
            "interleave_moe_layer_step": a.moe_step, **hf_rules.rope_config(a)}


# -- tensors -------------------------------------------------------------------------------------
def _pairs_to_halves(head_dim: int) -> Callable[[torch.Tensor], tuple[torch.Tensor]]:
    """q/k rows (H * hd, ...) with each head's rotary pairs adjacent (2i, 2i + 1) -> each
    head's first members, then its second ones (i, i + hd/2)."""
    def to_forja(t: torch.Tensor) -> tuple[torch.Tensor]:
        return (t.reshape(-1, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous(),)
    return to_forja


def _halves_to_pairs(head_dim: int) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    def to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        t = ts[0]
        return t.reshape(-1, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
    return to_hf


def _gate_up_to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """gate_up_proj (E, D, 2H), gate columns first -> w1, w3 (E, H, D)."""
    return tuple(p.transpose(1, 2).contiguous() for p in t.chunk(2, dim=-1))


def _gate_up_to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([t.transpose(1, 2) for t in ts], dim=-1).contiguous()


def _transposed(t: torch.Tensor) -> tuple[torch.Tensor]:
    """down_proj (E, H, D), for h @ W -> w2 (E, D, H); and back."""
    return (t.transpose(1, 2).contiguous(),)


def _untransposed(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ts[0].transpose(1, 2).contiguous()


def _attention_rules(a: Llama4Args) -> list[TensorRule]:
    hf, ours = hf_rules.LAYER + "self_attn.", hf_rules.OURS + "attention."
    out = []
    for kind in ("weight", "bias") if a.attention_bias else ("weight",):
        out += [TensorRule(f"{hf}{p}_proj.{kind}", (f"{ours}w{p}.{kind}",), to_forja=_pairs_to_halves(a.head_dim),
                           to_hf=_halves_to_pairs(a.head_dim)) for p in "qk"]
        out += [TensorRule(f"{hf}{p}_proj.{kind}", (f"{ours}w{p}.{kind}",)) for p in "vo"]
    return out


def _layer_rules(a: Llama4Args, layer: int) -> list[TensorRule]:
    rules = [r for r in _attention_rules(a) + hf_rules.renamed(hf_rules.NORM_PAIRS["pre"])]
    hf, ours = hf_rules.LAYER + "feed_forward.", hf_rules.OURS + "feed_forward."
    if a.is_moe_layer(layer):
        rules += [TensorRule(hf + "router.weight", (ours + "router.gate.weight",)),
                  TensorRule(hf + "experts.gate_up_proj", (ours + "experts.w1", ours + "experts.w3"),
                             to_forja=_gate_up_to_forja, to_hf=_gate_up_to_hf),
                  TensorRule(hf + "experts.down_proj", (ours + "experts.w2",), to_forja=_transposed,
                             to_hf=_untransposed)]
        rules += hf_rules.renamed([(f"shared_expert.{h}", f"shared_experts.{f}") for h, f in hf_rules.SWIGLU_PAIRS],
                                  hf, ours)
    else:
        rules += hf_rules.renamed(hf_rules.SWIGLU_PAIRS, hf, ours)
    return [TensorRule(r.hf.format(i=layer), tuple(f.format(i=layer) for f in r.forja), r.to_forja, r.to_hf)
            for r in rules]


def rules(a: Llama4Args) -> list[TensorRule]:
    return hf_rules.decoder_rules(a, lambda i: _layer_rules(a, i))


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
