"""Hugging Face `Gemma4ForCausalLM` (model_type gemma4_text, transformers 5.25) <-> forja Gemma 4.

Reads both ways a config.json gives the global blocks' shape: the released one
(`global_head_dim`, `num_global_key_value_heads`, the latter only read with
`attention_k_eq_v`, as transformers does) and transformers 5.25's own, `per_layer_config`
keyed by layer index, which must give every global block the same head width and key/value
heads and the local ones nothing (any other per-layer difference is refused). forja writes
`per_layer_config`. RoPE uses the rotate-half layout, as forja does: q/k weights load
unpermuted. Norm weights are the scales themselves (no offset from one), copied as they are;
each block's `layer_scalar` buffer is read and written like a weight. Shared key/value blocks
store no k/v projections or norms. The multimodal checkpoints (Gemma4ForConditionalGeneration,
model_type gemma4: vision and audio towers) are not read.

The mixture of experts (`enable_moe_block`, the 26B-A4B; forja/models/gemma4/moe.py) in every
block: `num_experts`, `top_k_experts`, `moe_intermediate_size`; its tensors as transformers'
modules hold them (no conversion of names on save or load): in forja the block's feed_forward
is then the mixture and `mlp` the dense MLP beside it. router.proj/scale/per_expert_scale ->
feed_forward.router.gate/norm/per_expert_scale, experts.gate_up_proj (E, 2H, D, gate rows
first) -> feed_forward.experts.w1, w3 and experts.down_proj (E, D, H) -> w2,
pre_feedforward_layernorm_2 -> feed_forward.expert_norm, mlp.* -> mlp.*,
post_feedforward_layernorm_1/_2 -> post_mlp_norm/post_moe_norm. Without enable_moe_block the
expert keys are not read (transformers builds no experts then either).
"""

from __future__ import annotations

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.gemma3.model import gemma3_layer_types
from forja.models.gemma4.model import Gemma4Args

ARCHITECTURES = ("Gemma4ForCausalLM",)
IGNORED: tuple[str, ...] = ()

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma4TextConfig's default rope parameters
_refuse = hf_rules.refusal("Gemma 4")


def _check_supported(cfg: dict) -> None:
    hf_rules.check_config(cfg, [
        hf_rules.no_attention_bias("Gemma 4's projections have no biases"),
        hf_rules.activation("gelu_pytorch_tanh", "its MLPs are GeGLU with the tanh GELU, 'gelu_pytorch_tanh'",
                            key="hidden_activation"),
        hf_rules.Unsupported("use_bidirectional_attention", lambda v: v in (None, "vision"),
                             "forja's decoder attends causally ('vision' concerns image tokens only)"),
        hf_rules.NO_ATTENTION_DROPOUT,
    ], _refuse)


def _layer_types(cfg: dict, n_layers: int) -> tuple[str, ...]:
    """config.json's layer_types, or transformers' five local to one global; the last block
    made global whatever the file says, as Gemma4TextConfig does."""
    kinds = list(cfg.get("layer_types") or gemma3_layer_types(n_layers))
    bad = [k for k in kinds if k not in ("full_attention", "sliding_attention")]
    if bad:
        raise _refuse("layer_types", bad[0], "each block is 'full_attention' or 'sliding_attention'")
    kinds[-1] = "full_attention"
    return tuple(kinds)


def _global_shape(cfg: dict, kinds: tuple[str, ...], n_kv_heads: int) -> tuple[int, int]:
    """(head width, key/value heads) of the global blocks, from either dialect."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        return int(cfg.get("global_head_dim") or 512), int(kv or n_kv_heads)
    shapes = set()
    for i, kind in enumerate(kinds):
        over = dict(per_layer.get(str(i), per_layer.get(i)) or {})
        if kind == "sliding_attention" and over:
            raise _refuse(f"per_layer_config.{i}", over, "only the global blocks may differ, in their heads")
        if kind == "full_attention":
            if set(over) - {"head_dim", "num_key_value_heads"}:
                raise _refuse(f"per_layer_config.{i}", over, "a block may differ only in head_dim and "
                              "num_key_value_heads")
            shapes.add((int(over.get("head_dim", cfg.get("head_dim", 256))),
                        int(over.get("num_key_value_heads", n_kv_heads))))
    if len(shapes) > 1:
        raise _refuse("per_layer_config", per_layer, "every global block must have the same heads")
    return shapes.pop()


def _rope(cfg: dict) -> dict:
    """rope_theta, local_rope_theta, global_rotary_fraction and rope_linear_factor."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if local.get("rope_type", "default") != "default":
        raise _refuse("rope_parameters.sliding_attention.rope_type", local["rope_type"],
                      "forja's Gemma 4 turns its local blocks with plain RoPE, 'default'")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise _refuse("rope_parameters.full_attention.rope_type", kind,
                      "forja's Gemma 4 reads 'default' and 'proportional' for its global blocks")
    proportional = kind == "proportional"
    return dict(rope_theta=float(full.get("rope_theta", _GLOBAL_THETA)),
                local_rope_theta=float(local.get("rope_theta", _LOCAL_THETA)),
                global_rotary_fraction=float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
                rope_linear_factor=float(full.get("factor", 1.0)) if proportional else 1.0)


def args_from_config(cfg: dict) -> Gemma4Args:
    _check_supported(cfg)
    # transformers' defaults where a key is absent, as its Gemma4TextConfig reads them.
    args = hf_rules.decoder_args(cfg, num_key_value_heads=4, head_dim=256, vocab_size=262_144,
                                 max_position_embeddings=131_072, tie_word_embeddings=True)
    kinds = _layer_types(cfg, args["n_layers"])
    global_head_dim, global_kv_heads = _global_shape(cfg, kinds, args["n_kv_heads"])
    ple_dim = cfg.get("hidden_size_per_layer_input", 256) or 0
    return Gemma4Args(
        **args, **_rope(cfg), **_experts(cfg), sliding_window=cfg.get("sliding_window", 512), layer_types=kinds,
        global_head_dim=global_head_dim, global_kv_heads=global_kv_heads,
        attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
        kv_shared_layers=int(cfg.get("num_kv_shared_layers") or 0),
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        ple_dim=int(ple_dim), ple_vocab_size=int(cfg.get("vocab_size_per_layer_input", 262_144)) if ple_dim else 0,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )


def _experts(cfg: dict) -> dict:
    """The MoEArgs fields of `enable_moe_block`'s mixture; {} (none) without it."""
    if not cfg.get("enable_moe_block"):
        return {}
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not cfg.get(k)]
    if missing:
        raise _refuse(missing[0], cfg.get(missing[0]), "enable_moe_block needs num_experts, top_k_experts and "
                      "moe_intermediate_size")
    return dict(n_experts=int(cfg["num_experts"]), top_k=int(cfg["top_k_experts"]),
                moe_ffn_dim=int(cfg["moe_intermediate_size"]), score_func="softmax", norm_topk_prob=True)


def _export_problems(a: Gemma4Args) -> dict[str, tuple[bool, str]]:
    """What transformers' Gemma 4 cannot express, by args field."""
    problems = {
        "query_pre_attn_scalar": (a.query_pre_attn_scalar != 1, "Gemma 4 does not scale attention scores"),
        "layer_types": (a.layer_type(a.n_layers - 1) != "full_attention",
                        "transformers makes a Gemma 4's last block global"),
    }
    if a.n_experts:
        problems |= {
            **hf_rules.router_problems(a, "Gemma 4", "its"),
            "norm_topk_prob": (not a.norm_topk_prob, "its router renormalizes the chosen experts' weights"),
            "router_bias": (a.router_bias, "its router has no bias"),
            "expert_proj_bias": (a.expert_proj_bias, "its experts have no biases"),
            "expert_activation": (a.expert_activation != "geglu", "its experts are GeGLUs"),
            "n_shared_experts": (a.n_shared_experts > 0, "its dense MLP beside the experts has their place"),
            "scale_expert_input": (a.scale_expert_input, "its experts weigh their outputs"),
        }
    return problems


def config_from_args(a: Gemma4Args) -> dict:
    hf_rules.check_exportable(a, "a Gemma 4", _export_problems(a))
    full = {"rope_type": "proportional", "partial_rotary_factor": a.global_rotary_fraction, "rope_theta": a.rope_theta}
    if a.rope_linear_factor != 1.0:
        full["factor"] = a.rope_linear_factor
    per_layer = {str(i): {"head_dim": a.global_head_dim, "num_key_value_heads": a.global_kv_heads}
                 for i in range(a.n_layers) if a.layer_type(i) == "full_attention"}
    return {"architectures": list(ARCHITECTURES), "model_type": "gemma4_text", **hf_rules.decoder_config(a),
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "final_logit_softcapping": a.final_logit_softcap, "attention_k_eq_v": a.attention_k_eq_v,
            "num_kv_shared_layers": a.kv_shared_layers, "use_double_wide_mlp": a.double_wide_mlp,
            "hidden_size_per_layer_input": a.ple_dim, "vocab_size_per_layer_input": a.ple_vocab_size or a.vocab_size,
            "enable_moe_block": bool(a.n_experts), "num_experts": a.n_experts or None,
            "top_k_experts": a.top_k if a.n_experts else None,
            "moe_intermediate_size": a.moe_ffn_dim if a.n_experts else None,
            "per_layer_config": per_layer,
            **hf_rules.layer_types_config(a, full, a.local_rope_theta)}


def _layer_rules(a: Gemma4Args, i: int) -> list[TensorRule]:
    """Block i's tensors: a shared block has no k/v projections or k-norm, a global block with
    attention_k_eq_v no v projection; per-layer input modules where the model has them."""
    shared = i >= a.first_shared_layer
    no_v = shared or (a.attention_k_eq_v and a.layer_type(i) == "full_attention")
    pairs = [(f"self_attn.{p}_proj.weight", f"attention.w{p}.weight") for p in "qkvo"
             if not (p == "k" and shared) and not (p == "v" and no_v)]
    pairs += [(f"self_attn.{n}.weight", f"attention.{n}.weight") for n in ("q_norm", "k_norm")
              if not (n == "k_norm" and shared)]
    # With experts the block's feed_forward is the mixture, and the dense MLP is `mlp` in both.
    mlp = [(f"mlp.{h}", f"mlp.{f}") for h, f in hf_rules.SWIGLU_PAIRS] if a.n_experts else hf_rules.MLP_PAIRS
    pairs += [*hf_rules.NORM_PAIRS["sandwich"], *mlp, ("layer_scalar", "layer_scalar")]
    if a.ple_dim:
        pairs += [("per_layer_input_gate.weight", "ple_gate.weight"),
                  ("per_layer_projection.weight", "ple_proj.weight"),
                  ("post_per_layer_input_norm.weight", "ple_norm.weight")]
    if a.n_experts:
        pairs += [("router.proj.weight", "feed_forward.router.gate.weight"),
                  ("router.scale", "feed_forward.router.norm.weight"),
                  ("router.per_expert_scale", "feed_forward.router.per_expert_scale"),
                  ("pre_feedforward_layernorm_2.weight", "feed_forward.expert_norm.weight"),
                  ("post_feedforward_layernorm_1.weight", "post_mlp_norm.weight"),
                  ("post_feedforward_layernorm_2.weight", "post_moe_norm.weight")]
    layer, ours = f"model.layers.{i}.", f"layers.{i}."
    experts = hf_rules.expert_rules(a, layer, ours + "feed_forward.", fused=True) if a.n_experts else []
    return hf_rules.renamed(pairs, layer, ours) + experts


def rules(a: Gemma4Args) -> list[TensorRule]:
    out = hf_rules.decoder_rules(a, lambda i: _layer_rules(a, i))
    if a.ple_dim:
        out += hf_rules.renamed([("embed_tokens_per_layer.weight", "ple_embeddings.weight"),
                                 ("per_layer_model_projection.weight", "ple_projection.weight"),
                                 ("per_layer_projection_norm.weight", "ple_projection_norm.weight")],
                                "model.", "")
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
