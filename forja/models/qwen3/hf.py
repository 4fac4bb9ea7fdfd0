"""Hugging Face `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` <-> forja Qwen3.

Reads both config.json dialects (4.x `rope_theta`, as the released checkpoints have; 5.x
`rope_parameters`) and both names of the expert count (`num_experts`; 5.x writes
`num_local_experts`). RoPE uses the rotate-half layout, as forja does, so q/k weights
load unpermuted; q_norm/k_norm are per-head RMSNorms, forja's attention.q_norm/k_norm.

Experts: the released checkpoints, and transformers 5's `save_pretrained` by default,
hold one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, (H, D));
forja holds one stacked (E, H, D) tensor per projection, each expert a slice (a
`stacked` TensorRule). transformers 5's own modules hold the experts fused
(`mlp.experts.gate_up_proj` (E, 2H, D), gate rows first, and `mlp.experts.down_proj`
(E, D, H)), which `save_pretrained(save_original_format=False)` writes as is; forja
reads that layout too and always writes the per-expert one.
"""

from __future__ import annotations

import torch

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule, decoder_config
from forja.models.common.rope import ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.qwen3.model import Qwen3Args

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need

# Options of other mixture-of-experts families that a Qwen3-MoE has no place for: when
# set (to other than their neutral value), the checkpoint is not one forja can run exactly.
_FOREIGN_ROUTER = {"shared_expert_intermediate_size": 0, "n_shared_experts": 0, "router_jitter_noise": 0.0,
                   "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "scoring_func": "softmax",
                   "topk_method": "greedy", "moe_layer_freq": 1, "first_k_dense_replace": 0}


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's Qwen3 ({why})")


def _check_supported(cfg: dict) -> None:
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias", True, "Qwen3 attention has no biases; QK-norm replaces them")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "its MLPs are SwiGLU, 'silu'")
    if cfg.get("use_sliding_window"):
        raise _refuse("use_sliding_window", True, "every layer attends to the full context")
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise _refuse("layer_types", sliding[0], "every layer is 'full_attention'")
    for key in ("rope_scaling", "rope_parameters"):  # 4.x and 5.x dialects
        scaling = cfg.get(key) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default" and kind not in ROPE_TYPES:
            raise _refuse(f"{key}.rope_type", kind, "'default', 'llama3' or 'yarn'")
    for key, neutral in _FOREIGN_ROUTER.items():
        if cfg.get(key, neutral) not in (neutral, None):
            raise _refuse(key, cfg[key], f"a Qwen3-MoE router has no such option; it must be {neutral!r} or absent")


def _n_experts(cfg: dict) -> int:
    if "Qwen3MoeForCausalLM" not in (cfg.get("architectures") or []):
        return 0
    # transformers' defaults where a key is absent, as its Qwen3MoeConfig reads them.
    return int(cfg.get("num_experts", cfg.get("num_local_experts", 128)) or 0)


def _default_head_dim(cfg: dict) -> int:
    """transformers' head width when config.json names none: Qwen3Config's default is 128,
    Qwen3MoeConfig has no such field and divides."""
    if "Qwen3MoeForCausalLM" in (cfg.get("architectures") or []):
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return 128


def args_from_config(cfg: dict) -> Qwen3Args:
    _check_supported(cfg)
    params = cfg.get("rope_parameters") or {}
    n_experts = _n_experts(cfg)
    moe = {}
    if n_experts:
        moe = dict(n_experts=n_experts, top_k=cfg.get("num_experts_per_tok", 8),
                   moe_ffn_dim=cfg.get("moe_intermediate_size", 768),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), score_func="softmax",
                   decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
    return Qwen3Args(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or _default_head_dim(cfg),
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 32768),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=True,
        # transformers' default when a config names no base (as its Qwen3Config does).
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
        rope_scaling=rope_scaling_from_hf(cfg.get("rope_scaling") or params, cfg.get("max_position_embeddings", 32768)),
        **moe,
    )


def _check_exportable(a: Qwen3Args) -> None:
    """Refuse a forja Qwen3 that transformers' Qwen3 classes cannot express."""
    problems = {
        "qk_norm": (a.qk_norm is False, "transformers' Qwen3 always normalizes q and k"),
        "sliding_window": (a.sliding_window is not None, "export a model trained on the full context"),
        "n_shared_experts": (a.n_shared_experts > 0, "Qwen3-MoE has no shared expert"),
        "score_func": (a.score_func != "softmax", "Qwen3-MoE's router is a softmax"),
        "route_scale": (a.route_scale != 1.0, "Qwen3-MoE does not scale routing weights"),
        "n_expert_groups": (a.n_expert_groups > 1, "Qwen3-MoE routes over all experts at once"),
        "expert_bias": (a.expert_bias, "Qwen3-MoE's router has no bias"),
    }
    for field, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"a Qwen3 with {field}={getattr(a, field)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def config_from_args(a: Qwen3Args) -> dict:
    _check_exportable(a)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if a.n_experts else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if a.n_experts else "qwen3",
        **decoder_config(a),
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        # The 4.x dialect: what the released Qwen3 checkpoints use, and 5.x still reads.
        "rope_theta": a.rope_theta,
        "rope_scaling": None if a.rope_scaling is None else rope_scaling_to_hf(a.rope_scaling),
    }
    if a.n_experts:
        cfg.update(num_experts=a.n_experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_ffn_dim,
                   norm_topk_prob=a.norm_topk_prob, decoder_sparse_step=a.decoder_sparse_step,
                   mlp_only_layers=list(a.mlp_only_layers))
    return cfg


_ATTENTION_AND_NORMS = [
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("self_attn.q_norm.weight", "attention.q_norm.weight"),
    ("self_attn.k_norm.weight", "attention.k_norm.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
]
_DENSE_MLP = [
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
]
_PER_EXPERT = [  # slice e of forja's stacked tensor <- expert e's own tensor
    ("mlp.experts.{e}.gate_proj.weight", "feed_forward.experts.w1"),
    ("mlp.experts.{e}.up_proj.weight", "feed_forward.experts.w3"),
    ("mlp.experts.{e}.down_proj.weight", "feed_forward.experts.w2"),
]


def _split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(E, 2H, D), gate rows then up rows -> w1 (E, H, D), w3 (E, H, D)."""
    return tuple(p.contiguous() for p in t.chunk(2, dim=1))


def _join_gate_up(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat(ts, dim=1)


def _layer_rules(a: Qwen3Args, i: int, fused_experts: bool) -> list[TensorRule]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    out = [TensorRule(hf + h, (ours + f,)) for h, f in _ATTENTION_AND_NORMS]
    if not a.is_moe_layer(i):
        return out + [TensorRule(hf + h, (ours + f,)) for h, f in _DENSE_MLP]
    out.append(TensorRule(hf + "mlp.gate.weight", (ours + "feed_forward.router.gate.weight",)))
    if fused_experts:
        experts = ours + "feed_forward.experts."
        return out + [
            TensorRule(hf + "mlp.experts.gate_up_proj", (experts + "w1", experts + "w3"),
                       to_forja=_split_gate_up, to_hf=_join_gate_up),
            TensorRule(hf + "mlp.experts.down_proj", (experts + "w2",)),
        ]
    return out + [TensorRule(hf + h, (ours + f,), stacked=a.n_experts) for h, f in _PER_EXPERT]


def _rules(a: Qwen3Args, fused_experts: bool) -> list[TensorRule]:
    # Written per layer, not with "{i}": which blocks are mixtures of experts varies by layer.
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    for i in range(a.n_layers):
        out += _layer_rules(a, i, fused_experts)
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


def rules(a: Qwen3Args) -> list[TensorRule]:
    """The released checkpoints' layout: one tensor per expert."""
    return _rules(a, fused_experts=False)


def other_layouts(a: Qwen3Args) -> list[list[TensorRule]]:
    """transformers 5's fused experts, for an MoE model."""
    return [_rules(a, fused_experts=True)] if a.n_experts else []


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED,
                    other_layouts=other_layouts)
