"""Hugging Face `GptOssForCausalLM` <-> forja gpt-oss.

forja reads and writes what transformers 5.24 holds and saves: the weights in bf16 or fp32.
The released checkpoints store the experts MXFP4-quantized (`*_blocks`, `*_scales` tensors,
a `quantization_config`), which forja refuses: dequantize them first (transformers loads
them with `Mxfp4Config(dequantize=True)`, and its `save_pretrained` then writes this layout).

Reads both config.json dialects (4.x `rope_theta` + `rope_scaling`, as released; 5.x
`rope_parameters`). With neither, transformers' GptOssConfig default applies: YaRN, factor
32 over 4,096 tokens, beta 32 / 1, `truncate: false`. A YaRN dict that names no `truncate`
rounds the ramp's bounds (transformers' default, true). Absent `layer_types`: alternating
sliding and full, sliding first. RoPE is rotate-half, as forja's, so q/k load unpermuted.

Tensors (transformers 5 keeps the module names; no conversion on save):
- `self_attn.{q,k,v,o}_proj.{weight,bias}` -> attention.w{q,k,v,o}; `self_attn.sinks` (H,);
- `mlp.router.{weight,bias}` -> feed_forward.router.gate;
- `mlp.experts.gate_up_proj` (E, D, 2H), stored for x @ W with gate and up interleaved
  (even columns gate, odd up) -> w1, w3 (E, H, D); `gate_up_proj_bias` (E, 2H) -> b1, b3
  likewise; `down_proj` (E, H, D) -> w2 (E, D, H); `down_proj_bias` (E, D) -> b2.

Read by nothing: `hidden_act` (transformers' gpt-oss does not read it: the experts' clamped
SwiGLU is fixed), `attention_dropout` (training only), `output_router_logits` /
`router_aux_loss_coef` (a training loss; forja's `aux_loss_weight` is set in the run's config).
"""

from __future__ import annotations

import torch

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule, decoder_config
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.gpt_oss.model import GptOssArgs, alternating_layer_types

ARCHITECTURES = ("GptOssForCausalLM",)
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's gpt-oss ({why})")


def _rope(cfg: dict) -> tuple[float, YarnScaling | RopeScaling | None]:
    """(rope base, YaRN or None for plain RoPE), as transformers' GptOssConfig reads them."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 150_000.0)))
    key = "rope_parameters" if params else "rope_scaling"
    scaling = params or cfg.get("rope_scaling")
    if not scaling:  # transformers' default for gpt-oss
        return theta, YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0,
                                  truncate=False)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "llama3"):
        return theta, rope_scaling_from_hf(scaling, cfg.get("max_position_embeddings", 4096))
    if kind != "yarn":
        raise _refuse(f"{key}.rope_type", kind, "forja reads 'yarn', 'llama3' and 'default'")
    original = int(scaling.get("original_max_position_embeddings") or 4096)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention_factor = scaling.get("attention_factor")
    return theta, YarnScaling(
        factor=float(factor), original_max_seq_len=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0), beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling.get("mscale") or 0.0), mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(scaling.get("truncate", True)))


def args_from_config(cfg: dict) -> GptOssArgs:
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method, "forja loads the bf16/fp32 layout: dequantize the "
                      "experts first, e.g. from_pretrained with Mxfp4Config(dequantize=True) then save_pretrained")
    theta, scaling = _rope(cfg)
    n_layers = cfg["num_hidden_layers"]
    # Defaults where a key is absent are transformers' GptOssConfig's.
    return GptOssArgs(
        dim=cfg.get("hidden_size", 2880),
        n_layers=n_layers,
        n_heads=cfg.get("num_attention_heads", 64),
        n_kv_heads=cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 64),
        head_dim=cfg.get("head_dim") or 64,
        ffn_dim=cfg.get("intermediate_size", 2880),
        vocab_size=cfg.get("vocab_size", 201_088),
        max_seq_len=cfg.get("max_position_embeddings", 131_072),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)),
        sliding_window=cfg.get("sliding_window", 128),
        layer_types=tuple(cfg.get("layer_types") or alternating_layer_types(n_layers)),
        rope_theta=theta,
        rope_scaling=scaling,
        n_experts=cfg.get("num_local_experts", cfg.get("num_experts", 128)),
        top_k=cfg.get("num_experts_per_tok", 4),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def _check_exportable(a: GptOssArgs) -> None:
    """Refuse a forja gpt-oss that transformers' GptOssForCausalLM cannot express."""
    problems = {
        "qk_norm": (a.qk_norm, "gpt-oss's attention normalizes neither queries nor keys"),
        "attention_sinks": (not a.attention_sinks, "every gpt-oss attention layer has sinks"),
        "score_func": (a.score_func != "topk_softmax", "gpt-oss takes a softmax over the top-k router logits"),
        "router_bias": (not a.router_bias, "gpt-oss's router always has a bias"),
        "expert_proj_bias": (not a.expert_proj_bias, "gpt-oss's experts always have biases"),
        "expert_activation": (a.expert_activation != "clamped_swiglu", "gpt-oss's experts use the clamped SwiGLU"),
        "n_shared_experts": (a.n_shared_experts > 0, "gpt-oss has no shared expert"),
        "route_scale": (a.route_scale != 1.0, "gpt-oss does not scale routing weights"),
        "n_expert_groups": (a.n_expert_groups > 1, "gpt-oss routes over all experts at once"),
        "expert_bias": (a.expert_bias, "gpt-oss's router has no balancing bias"),
        "capacity_factor": (a.capacity_factor > 0, "gpt-oss drops no tokens"),
    }
    for name, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"a gpt-oss with {name}={getattr(a, name)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def _rope_scaling(a: GptOssArgs) -> dict:
    # Written even for plain RoPE: with no rope_scaling at all, transformers would apply YaRN.
    s = a.rope_scaling
    if s is None:
        return {"rope_type": "default"}
    if isinstance(s, RopeScaling):
        return rope_scaling_to_hf(s)
    out = {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
    if s.mscale or s.mscale_all_dim:
        out.update(mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)
    if s.attention_factor is not None:
        out["attention_factor"] = s.attention_factor
    return out


def config_from_args(a: GptOssArgs) -> dict:
    _check_exportable(a)
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "gpt_oss",
        **decoder_config(a),
        "attention_bias": a.attention_bias,
        "sliding_window": a.sliding_window,
        "layer_types": [a.layer_type(i) for i in range(a.n_layers)],
        "num_local_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "swiglu_limit": a.swiglu_limit,
        "swiglu_alpha": a.swiglu_alpha,
        # The 4.x dialect, as the released checkpoints write it; 5.x reads it too.
        "rope_theta": a.rope_theta,
        "rope_scaling": _rope_scaling(a),
    }


def _split_interleaved(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 2H) with gate and up interleaved -> gate (..., H), up (..., H)."""
    return t[..., 0::2], t[..., 1::2]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=-1).flatten(-2)  # (..., H, 2) -> (..., 2H): gate_h, up_h, ...


def _gate_up_to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """gate_up_proj (E, D, 2H) -> w1, w3 (E, H, D)."""
    return tuple(p.transpose(1, 2).contiguous() for p in _split_interleaved(t))


def _gate_up_to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _interleave(ts[0].transpose(1, 2), ts[1].transpose(1, 2)).contiguous()


def _gate_up_bias_to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """gate_up_proj_bias (E, 2H) -> b1, b3 (E, H)."""
    return tuple(p.contiguous() for p in _split_interleaved(t))


def _gate_up_bias_to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _interleave(*ts).contiguous()


def _transposed(t: torch.Tensor) -> tuple[torch.Tensor]:
    """down_proj (E, H, D), for h @ W -> w2 (E, D, H); and back."""
    return (t.transpose(1, 2).contiguous(),)


def _untransposed(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ts[0].transpose(1, 2).contiguous()


def rules(a: GptOssArgs) -> list[TensorRule]:
    hf, ours = "model.layers.{i}.", "layers.{i}."
    experts = ours + "feed_forward.experts."
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    params = ("weight", "bias") if a.attention_bias else ("weight",)
    out += [TensorRule(f"{hf}self_attn.{p}_proj.{kind}", (f"{ours}attention.w{p}.{kind}",))
            for p in "qkvo" for kind in params]
    out += [
        TensorRule(hf + "self_attn.sinks", (ours + "attention.sinks",)),
        TensorRule(hf + "input_layernorm.weight", (ours + "attention_norm.weight",)),
        TensorRule(hf + "post_attention_layernorm.weight", (ours + "ffn_norm.weight",)),
        TensorRule(hf + "mlp.router.weight", (ours + "feed_forward.router.gate.weight",)),
        TensorRule(hf + "mlp.router.bias", (ours + "feed_forward.router.gate.bias",)),
        TensorRule(hf + "mlp.experts.gate_up_proj", (experts + "w1", experts + "w3"),
                   to_forja=_gate_up_to_forja, to_hf=_gate_up_to_hf),
        TensorRule(hf + "mlp.experts.gate_up_proj_bias", (experts + "b1", experts + "b3"),
                   to_forja=_gate_up_bias_to_forja, to_hf=_gate_up_bias_to_hf),
        TensorRule(hf + "mlp.experts.down_proj", (experts + "w2",), to_forja=_transposed, to_hf=_untransposed),
        TensorRule(hf + "mlp.experts.down_proj_bias", (experts + "b2",)),
    ]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
