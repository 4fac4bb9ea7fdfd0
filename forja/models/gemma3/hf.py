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

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.gemma3.model import Gemma3Args, gemma3_layer_types

ARCHITECTURES = ("Gemma3ForCausalLM",)
IGNORED: tuple[str, ...] = ()

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig.default_theta
_refuse = hf_rules.refusal("Gemma 3")


def _check_supported(cfg: dict) -> None:
    hf_rules.check_config(cfg, [
        hf_rules.no_attention_bias("Gemma 3's projections have no biases"),
        hf_rules.activation("gelu_pytorch_tanh", "its MLPs are GeGLU with the tanh GELU, 'gelu_pytorch_tanh'",
                   key="hidden_activation", default=cfg.get("hidden_act", "gelu_pytorch_tanh")),
        hf_rules.Unsupported("attn_logit_softcapping", lambda v: v is None,
                    "forja's attention does not soft-cap its scores; Gemma 3 sets it to null"),
        hf_rules.Unsupported("use_bidirectional_attention", lambda v: not v, "forja's decoder attends causally"),
        hf_rules.NO_ATTENTION_DROPOUT,
    ], _refuse)


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
    local = cfg.get("rope_local_base_freq", _LOCAL_THETA)
    ropes = hf_rules.rope_by_layer_type(cfg, _refuse, "Gemma 3", _GLOBAL_THETA, local)
    # transformers' defaults where a key is absent, as its Gemma3TextConfig reads them.
    args = hf_rules.decoder_args(cfg, num_key_value_heads=4, head_dim=256, vocab_size=262_208,
                        max_position_embeddings=131_072, tie_word_embeddings=True)
    full = ropes["full_attention"]
    return Gemma3Args(
        **args, sliding_window=cfg.get("sliding_window", 4096),
        layer_types=tuple(cfg.get("layer_types")
                          or gemma3_layer_types(args["n_layers"], cfg.get("sliding_window_pattern", 6))),
        rope_theta=float(full["rope_theta"]), local_rope_theta=float(ropes["sliding_attention"]["rope_theta"]),
        rope_linear_factor=_linear_factor(ropes),
        # Gemma 3's linear scaling is its own field (rope_linear_factor, the released 4B-27B's)
        rope_scaling=rope_scaling_from_hf(full, args["max_seq_len"])
        if full.get("rope_type") in ROPE_TYPES and full.get("rope_type") != "linear" else None,
        query_pre_attn_scalar=int(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )


def config_from_args(a: Gemma3Args) -> dict:
    hf_rules.check_exportable(a, "a Gemma 3", {
        "qk_norm": (not a.qk_norm, "transformers' Gemma 3 always normalizes q and k"),
        "attention_sinks": (a.attention_sinks, "Gemma 3's attention has no sinks"),
        "n_heads": (a.dim % a.n_heads != 0, "transformers' Gemma3TextConfig needs dim divisible by n_heads"),
        "mtp_depth": (a.mtp_depth > 0, "Gemma 3 has no multi-token prediction"),
    })
    full = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_linear_factor != 1.0:
        full.update(rope_type="linear", factor=a.rope_linear_factor)
    if a.rope_scaling is not None:
        full = {**rope_scaling_to_hf(a.rope_scaling), "rope_theta": a.rope_theta}
    return {"architectures": list(ARCHITECTURES), "model_type": "gemma3_text", **hf_rules.decoder_config(a),
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "query_pre_attn_scalar": a.query_pre_attn_scalar, "final_logit_softcapping": a.final_logit_softcap,
            "attn_logit_softcapping": None, **hf_rules.layer_types_config(a, full, a.local_rope_theta)}


def rules(a: Gemma3Args) -> list[TensorRule]:
    layer = [*hf_rules.attention_pairs(qk_norm=True), *hf_rules.NORM_PAIRS["sandwich"], *hf_rules.MLP_PAIRS]
    return hf_rules.decoder_rules(a, hf_rules.renamed(layer))


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
