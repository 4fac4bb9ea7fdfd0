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

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.qwen3.model import Qwen3Args

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need

_refuse = hf_rules.refusal("Qwen3")
_SUPPORTED = [
    hf_rules.no_attention_bias("Qwen3 attention has no biases; QK-norm replaces them"),
    hf_rules.activation("silu", "its MLPs are SwiGLU, 'silu'"),
    hf_rules.Unsupported("use_sliding_window", lambda v: not v, "every layer attends to the full context"),
]
# Options of other mixture-of-experts families that a Qwen3-MoE has no place for: when
# set (to other than their neutral value), the checkpoint is not one forja can run exactly.
_FOREIGN_ROUTER = hf_rules.neutral({
    "shared_expert_intermediate_size": 0, "n_shared_experts": 0, "router_jitter_noise": 0.0,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "scoring_func": "softmax", "topk_method": "greedy",
    "moe_layer_freq": 1, "first_k_dense_replace": 0}, "a Qwen3-MoE router")


def _check_supported(cfg: dict) -> None:
    hf_rules.check_config(cfg, _SUPPORTED, _refuse)
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise _refuse("layer_types", sliding[0], "every layer is 'full_attention'")
    hf_rules.check_rope_types(cfg, _refuse)
    hf_rules.check_config(cfg, _FOREIGN_ROUTER, _refuse)


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
    n_experts = _n_experts(cfg)
    moe = {}
    if n_experts:
        moe = dict(n_experts=n_experts, top_k=cfg.get("num_experts_per_tok", 8),
                   moe_ffn_dim=cfg.get("moe_intermediate_size", 768),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), score_func="softmax",
                   decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
    args = hf_rules.decoder_args(cfg, head_dim=_default_head_dim(cfg), max_position_embeddings=32768)
    # transformers' default base when a config names none (as its Qwen3Config does).
    return Qwen3Args(**args, qk_norm=True, **hf_rules.rope_args(cfg, args["max_seq_len"], 10_000.0), **moe)


def config_from_args(a: Qwen3Args) -> dict:
    hf_rules.check_exportable(a, "a Qwen3", {
        "qk_norm": (a.qk_norm is False, "transformers' Qwen3 always normalizes q and k"),
        "sliding_window": (a.sliding_window is not None, "export a model trained on the full context"),
        "n_shared_experts": (a.n_shared_experts > 0, "Qwen3-MoE has no shared expert"),
        **hf_rules.router_problems(a, "Qwen3-MoE", "Qwen3-MoE's"),
    })
    cfg = {"architectures": ["Qwen3MoeForCausalLM" if a.n_experts else "Qwen3ForCausalLM"],
           "model_type": "qwen3_moe" if a.n_experts else "qwen3", **hf_rules.decoder_config(a), "hidden_act": "silu",
           "attention_bias": False, "use_sliding_window": False, "sliding_window": None, **hf_rules.rope_config(a)}
    if a.n_experts:
        cfg.update(num_experts=a.n_experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_ffn_dim,
                   norm_topk_prob=a.norm_topk_prob, decoder_sparse_step=a.decoder_sparse_step,
                   mlp_only_layers=list(a.mlp_only_layers))
    return cfg


_ATTENTION_AND_NORMS = [*hf_rules.attention_pairs(qk_norm=True), *hf_rules.NORM_PAIRS["pre"]]


def _layer_rules(a: Qwen3Args, i: int, fused_experts: bool) -> list[TensorRule]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    out = hf_rules.renamed(_ATTENTION_AND_NORMS, hf, ours)
    if not a.is_moe_layer(i):
        return out + hf_rules.renamed(hf_rules.MLP_PAIRS, hf, ours)
    out.append(TensorRule(hf + "mlp.gate.weight", (ours + "feed_forward.router.gate.weight",)))
    return out + hf_rules.expert_rules(a, hf + "mlp.", ours + "feed_forward.", fused=fused_experts)


def _rules(a: Qwen3Args, fused_experts: bool) -> list[TensorRule]:
    # Per layer, not with "{i}": which blocks are mixtures of experts varies by layer.
    return hf_rules.decoder_rules(a, lambda i: _layer_rules(a, i, fused_experts))


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    **hf_rules.expert_layouts(_rules))
