"""Hugging Face `Gemma3ForCausalLM` (model_type gemma3_text) <-> forja Gemma 3.

Reads both config.json dialects: the released one (`rope_theta`, `rope_local_base_freq`,
`rope_scaling`, `sliding_window_pattern`) and transformers 5's (`rope_parameters` keyed by
layer type, `layer_types`), as transformers 5.24's Gemma3TextConfig does: `rope_scaling`
goes to the global (full-attention) blocks only. RoPE uses the rotate-half layout, as
forja does, so q/k weights load unpermuted. Every norm weight is stored as Gemma's offset
from one, as forja's zero-centered RMSNorm holds it: copied as is. forja writes the 5.x
dialect. The multimodal checkpoints (Gemma3ForConditionalGeneration) are not read.
"""

from __future__ import annotations

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule, decoder_config
from forja.models.common.rope import ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.gemma3.model import Gemma3Args, gemma3_layer_types

ARCHITECTURES = ("Gemma3ForCausalLM",)
IGNORED: tuple[str, ...] = ()

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig.default_theta


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's Gemma 3 ({why})")


def _check_supported(cfg: dict) -> None:
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias", True, "Gemma 3's projections have no biases")
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise _refuse("hidden_activation", act, "its MLPs are GeGLU with the tanh GELU, 'gelu_pytorch_tanh'")
    if cfg.get("attn_logit_softcapping") is not None:
        raise _refuse("attn_logit_softcapping", cfg["attn_logit_softcapping"],
                      "forja's attention does not soft-cap its scores; Gemma 3 sets it to null")
    if cfg.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", True, "forja's decoder attends causally")
    if cfg.get("attention_dropout"):
        raise _refuse("attention_dropout", cfg["attention_dropout"], "forja trains without attention dropout; set 0.0")


def _rope_parameters(cfg: dict) -> dict[str, dict]:
    """layer type -> its rope dict, as transformers 5.24's Gemma3TextConfig builds them."""
    params = cfg.get("rope_parameters")
    if params and not {"full_attention", "sliding_attention"} & set(params):
        raise _refuse("rope_parameters", params, "transformers 5 keys Gemma 3's rope parameters by layer type")
    params = {kind: dict(v or {}) for kind, v in (params or {}).items()}
    full = params.setdefault("full_attention", {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", _GLOBAL_THETA))
    sliding = params.setdefault("sliding_attention", {"rope_type": "default"})
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))
    return params


def _linear_factor(ropes: dict[str, dict]) -> float:
    for kind, rope in ropes.items():
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if kind == "full_attention" and rope_type in ("default", "linear", *ROPE_TYPES):
            continue
        if kind == "sliding_attention" and rope_type == "default":
            continue
        raise _refuse(f"rope_parameters.{kind}.rope_type", rope_type,
                      "forja's Gemma 3 reads 'default' and, for the global blocks, 'linear', 'llama3' and 'yarn'")
    full = ropes["full_attention"]
    return float(full.get("factor", 1.0)) if full.get("rope_type", full.get("type")) == "linear" else 1.0


def args_from_config(cfg: dict) -> Gemma3Args:
    _check_supported(cfg)
    ropes = _rope_parameters(cfg)
    n_layers = cfg["num_hidden_layers"]
    # transformers' defaults where a key is absent, as its Gemma3TextConfig reads them.
    layer_types = cfg.get("layer_types") or gemma3_layer_types(n_layers, cfg.get("sliding_window_pattern", 6))
    return Gemma3Args(
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads", 4),
        head_dim=cfg.get("head_dim", 256),
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg.get("vocab_size", 262_208),
        max_seq_len=cfg.get("max_position_embeddings", 131_072),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=cfg.get("sliding_window", 4096),
        layer_types=tuple(layer_types),
        rope_theta=float(ropes["full_attention"]["rope_theta"]),
        local_rope_theta=float(ropes["sliding_attention"]["rope_theta"]),
        rope_linear_factor=_linear_factor(ropes),
        rope_scaling=(rope_scaling_from_hf(ropes["full_attention"], cfg.get("max_position_embeddings", 131_072))
                      if ropes["full_attention"].get("rope_type") in ROPE_TYPES else None),
        query_pre_attn_scalar=int(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )


def _check_exportable(a: Gemma3Args) -> None:
    """Refuse a forja Gemma 3 that transformers' Gemma3ForCausalLM cannot express."""
    problems = {
        "qk_norm": (not a.qk_norm, "transformers' Gemma 3 always normalizes q and k"),
        "attention_sinks": (a.attention_sinks, "Gemma 3's attention has no sinks"),
        "n_heads": (a.dim % a.n_heads != 0, "transformers' Gemma3TextConfig needs dim divisible by n_heads"),
        "mtp_depth": (getattr(a, "mtp_depth", 0) > 0, "Gemma 3 has no multi-token prediction"),
    }
    for field, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"a Gemma 3 with {field}={getattr(a, field)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def config_from_args(a: Gemma3Args) -> dict:
    _check_exportable(a)
    full = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_linear_factor != 1.0:
        full.update(rope_type="linear", factor=a.rope_linear_factor)
    if a.rope_scaling is not None:
        full = {**rope_scaling_to_hf(a.rope_scaling), "rope_theta": a.rope_theta}
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "gemma3_text",
        **decoder_config(a),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": a.query_pre_attn_scalar,
        # transformers needs a window even when no block slides; it is unused then.
        "sliding_window": a.sliding_window if a.sliding_window is not None else 4096,
        "layer_types": [a.layer_type(i) for i in range(a.n_layers)],
        "final_logit_softcapping": a.final_logit_softcap,
        "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": a.local_rope_theta}},
    }


_LAYER = [
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("self_attn.q_norm.weight", "attention.q_norm.weight"),
    ("self_attn.k_norm.weight", "attention.k_norm.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
]


def rules(a: Gemma3Args) -> list[TensorRule]:
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    out += [TensorRule(f"model.layers.{{i}}.{h}", (f"layers.{{i}}.{f}",)) for h, f in _LAYER]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
