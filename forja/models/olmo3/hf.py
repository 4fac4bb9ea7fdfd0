"""Hugging Face `Olmo3ForCausalLM` <-> forja OLMo 3.

Reads both config.json dialects: 4.x `rope_theta` + `rope_scaling` (the released
checkpoints) and 5.x `rope_parameters` keyed by layer type ({"full_attention": {...},
"sliding_attention": {...}}, what transformers 5 writes). Read as transformers 5.24 reads
them: in the 4.x dialect `rope_scaling` (and `rope_theta`) go to the full-attention blocks
only, the sliding blocks taking Olmo3Config's default base, 500,000 (the released models'
value for both). RoPE uses the rotate-half layout, as forja does, so q/k weights load
unpermuted; q_norm/k_norm are RMSNorms over the whole projections (n_heads * head_dim
and n_kv_heads * head_dim wide), forja's attention.q_norm/k_norm with
`qk_norm_over_heads`. forja writes the 5.x dialect.
"""

from __future__ import annotations

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.olmo3.model import Olmo3Args

ARCHITECTURES = ("Olmo3ForCausalLM",)
IGNORED: tuple[str, ...] = ()

_DEFAULT_THETA = 500_000.0  # Olmo3Config.default_theta


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's OLMo 3 ({why})")


def _check_supported(cfg: dict) -> None:
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias", True, "OLMo 3's projections have no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "its MLPs are SwiGLU, 'silu'")
    if cfg.get("attention_dropout"):
        raise _refuse("attention_dropout", cfg["attention_dropout"], "forja trains without attention dropout; set 0.0")


def _rope_parameters(cfg: dict) -> dict[str, dict]:
    """layer type -> its rope dict, as transformers 5.24's Olmo3Config builds them."""
    params = cfg.get("rope_parameters")
    if params and not {"full_attention", "sliding_attention"} & set(params):
        raise _refuse("rope_parameters", params, "transformers 5 keys OLMo 3's rope parameters by layer type")
    params = {kind: dict(v or {}) for kind, v in (params or {}).items()}
    full = params.setdefault("full_attention", {"rope_type": "default"})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA))
    sliding = params.setdefault("sliding_attention", {"rope_type": "default"})
    sliding.setdefault("rope_theta", _DEFAULT_THETA)  # transformers 5.24 takes rope_theta for the full blocks only
    return params


def _kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _scaling(rope: dict, max_len: int) -> YarnScaling | RopeScaling | None:
    """The full-attention blocks' frequency scaling (common/rope.py reads each kind)."""
    kind = _kind(rope)
    if kind not in ("default", "llama3", "yarn"):
        raise _refuse("rope_scaling.rope_type", kind, "forja's OLMo 3 reads 'default', 'llama3' and 'yarn'")
    return rope_scaling_from_hf(rope, max_len)


def args_from_config(cfg: dict) -> Olmo3Args:
    _check_supported(cfg)
    ropes = _rope_parameters(cfg)
    if _kind(ropes["sliding_attention"]) != "default":
        raise _refuse("rope_parameters.sliding_attention.rope_type", _kind(ropes["sliding_attention"]),
                      "forja scales the full-attention blocks' frequencies only; 'default'")
    n_layers = cfg["num_hidden_layers"]
    max_len = cfg.get("max_position_embeddings", 2048)
    # transformers' defaults where a key is absent, as its Olmo3Config reads them.
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)]
    return Olmo3Args(
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=max_len,
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=cfg.get("sliding_window", 4096),
        layer_types=tuple(layer_types),
        rope_theta=float(ropes["full_attention"]["rope_theta"]),
        local_rope_theta=float(ropes["sliding_attention"]["rope_theta"]),
        rope_scaling=_scaling(ropes["full_attention"], max_len),
    )


def _check_exportable(a: Olmo3Args) -> None:
    """Refuse a forja OLMo 3 that transformers' Olmo3ForCausalLM cannot express."""
    problems = {
        "qk_norm": (not a.qk_norm, "transformers' OLMo 3 always normalizes q and k"),
        "attention_sinks": (a.attention_sinks, "OLMo 3's attention has no sinks"),
        "head_dim": (a.head_dim * a.n_heads != a.dim, "transformers' Olmo3Config derives it as dim / n_heads"),
        "mtp_depth": (getattr(a, "mtp_depth", 0) > 0, "OLMo 3 has no multi-token prediction"),
    }
    for field, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"an OLMo 3 with {field}={getattr(a, field)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def _yarn_dict(s: YarnScaling | RopeScaling, theta: float) -> dict:
    if isinstance(s, RopeScaling):
        return {**rope_scaling_to_hf(s), "rope_theta": theta}
    out = {"rope_type": "yarn", "rope_theta": theta, "factor": s.factor,
           "original_max_position_embeddings": s.original_max_seq_len, "beta_fast": s.beta_fast,
           "beta_slow": s.beta_slow, "truncate": s.truncate}
    if s.attention_factor is not None:
        out["attention_factor"] = s.attention_factor
    out.update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim") if getattr(s, k)})
    return out


def config_from_args(a: Olmo3Args) -> dict:
    _check_exportable(a)
    full = ({"rope_type": "default", "rope_theta": a.rope_theta} if a.rope_scaling is None
            else _yarn_dict(a.rope_scaling, a.rope_theta))
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "olmo3",
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "intermediate_size": a.ffn_dim,
        "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        # transformers needs a window even when no block slides; it is unused then.
        "sliding_window": a.sliding_window if a.sliding_window is not None else 4096,
        "layer_types": [a.layer_type(i) for i in range(a.n_layers)],
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
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffn_norm.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
]


def rules(a: Olmo3Args) -> list[TensorRule]:
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    out += [TensorRule(f"model.layers.{{i}}.{h}", (f"layers.{{i}}.{f}",)) for h, f in _LAYER]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
