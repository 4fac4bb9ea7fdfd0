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

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import (
    ROPE_NAMES,
    ROPE_TYPES,
    RopeScaling,
    YarnScaling,
    rope_scaling_from_hf,
    rope_scaling_to_hf,
    yarn_from_hf,
)
from forja.models.gpt_oss.model import GptOssArgs, alternating_layer_types

ARCHITECTURES = ("GptOssForCausalLM",)
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need

_refuse = hf_rules.refusal("gpt-oss")


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
    if kind != "default" and kind not in ROPE_TYPES:
        raise _refuse(f"{key}.rope_type", kind, f"forja reads {ROPE_NAMES}")
    if kind != "yarn":  # gpt-oss's YaRN defaults are its own (below); every other kind is common/rope.py's
        return theta, rope_scaling_from_hf(scaling, cfg.get("max_position_embeddings", 4096))
    return theta, yarn_from_hf(scaling, cfg.get("max_position_embeddings"), 4096)


def args_from_config(cfg: dict) -> GptOssArgs:
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method, "forja loads the bf16/fp32 layout: dequantize the "
                      "experts first, e.g. from_pretrained with Mxfp4Config(dequantize=True) then save_pretrained")
    theta, scaling = _rope(cfg)
    # Defaults where a key is absent are transformers' GptOssConfig's.
    args = hf_rules.decoder_args(cfg, hidden_size=2880, num_attention_heads=64, head_dim=64, intermediate_size=2880,
                        vocab_size=201_088, max_position_embeddings=131_072, rms_norm_eps=1e-5)
    return GptOssArgs(
        **args, attention_bias=bool(cfg.get("attention_bias", True)), sliding_window=cfg.get("sliding_window", 128),
        layer_types=tuple(cfg.get("layer_types") or alternating_layer_types(args["n_layers"])),
        rope_theta=theta, rope_scaling=scaling, n_experts=cfg.get("num_local_experts", cfg.get("num_experts", 128)),
        top_k=cfg.get("num_experts_per_tok", 4), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def config_from_args(a: GptOssArgs) -> dict:
    hf_rules.check_exportable(a, "a gpt-oss", {
        "qk_norm": (a.qk_norm, "gpt-oss's attention normalizes neither queries nor keys"),
        "attention_sinks": (not a.attention_sinks, "every gpt-oss attention layer has sinks"),
        **hf_rules.router_problems(a, "gpt-oss", "gpt-oss's"),
        "score_func": (a.score_func != "topk_softmax", "gpt-oss takes a softmax over the top-k router logits"),
        "expert_bias": (a.expert_bias, "gpt-oss's router has no balancing bias"),
        "router_bias": (not a.router_bias, "gpt-oss's router always has a bias"),
        "expert_proj_bias": (not a.expert_proj_bias, "gpt-oss's experts always have biases"),
        "expert_activation": (a.expert_activation != "clamped_swiglu", "gpt-oss's experts use the clamped SwiGLU"),
        "n_shared_experts": (a.n_shared_experts > 0, "gpt-oss has no shared expert"),
        "capacity_factor": (a.capacity_factor > 0, "gpt-oss drops no tokens"),
    })
    # rope_scaling is written even for plain RoPE: with none at all, transformers would apply YaRN.
    rope = {"rope_type": "default"} if a.rope_scaling is None else rope_scaling_to_hf(a.rope_scaling)
    # The 4.x dialect, as the released checkpoints write it; 5.x reads it too.
    return {"architectures": list(ARCHITECTURES), "model_type": "gpt_oss", **hf_rules.decoder_config(a),
            "attention_bias": a.attention_bias, "sliding_window": a.sliding_window,
            "layer_types": [a.layer_type(i) for i in range(a.n_layers)], "num_local_experts": a.n_experts,
            "num_experts_per_tok": a.top_k, "swiglu_limit": a.swiglu_limit, "swiglu_alpha": a.swiglu_alpha,
            "rope_theta": a.rope_theta, "rope_scaling": rope}


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
    hf, ours = "model.layers.{i}.mlp.", "layers.{i}.feed_forward."
    experts = ours + "experts."
    layer = [*hf_rules.attention_pairs(bias=a.attention_bias), ("self_attn.sinks", "attention.sinks"),
             *hf_rules.NORM_PAIRS["pre"]]
    return hf_rules.decoder_rules(a, hf_rules.renamed(layer) + [
        TensorRule(hf + "router.weight", (ours + "router.gate.weight",)),
        TensorRule(hf + "router.bias", (ours + "router.gate.bias",)),
        TensorRule(hf + "experts.gate_up_proj", (experts + "w1", experts + "w3"),
                   to_forja=_gate_up_to_forja, to_hf=_gate_up_to_hf),
        TensorRule(hf + "experts.gate_up_proj_bias", (experts + "b1", experts + "b3"),
                   to_forja=_gate_up_bias_to_forja, to_hf=_gate_up_bias_to_hf),
        TensorRule(hf + "experts.down_proj", (experts + "w2",), to_forja=_transposed, to_hf=_untransposed),
        TensorRule(hf + "experts.down_proj_bias", (experts + "b2",)),
    ])


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
