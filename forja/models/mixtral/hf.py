"""Hugging Face `MixtralForCausalLM` <-> forja Mixtral.

Reads both config.json dialects (4.x `rope_theta`, as the released checkpoints have; 5.x
`rope_parameters`). RoPE uses the rotate-half layout, as forja does, so q/k weights load
unpermuted. `sliding_window` is forja's own (a query sees the latest `sliding_window`
positions, itself included, as transformers' sliding mask and cache do).

Experts: the released checkpoints, and transformers 5's `save_pretrained` by default, hold
one tensor per expert and projection under `block_sparse_moe` (`experts.{e}.w1.weight`
gate, `w3` up, (H, D); `w2` down, (D, H); router `block_sparse_moe.gate.weight`); forja
holds one stacked (E, H, D) tensor per projection, each expert a slice (a `stacked`
TensorRule). transformers 5's own modules rename `block_sparse_moe` to `mlp` and fuse the
experts (`mlp.experts.gate_up_proj` (E, 2H, D), gate rows first; `mlp.experts.down_proj`
(E, D, H)), which `save_pretrained(save_original_format=False)` writes as is; forja reads
that layout too and always writes the released one.

`output_router_logits` / `router_aux_loss_coef` are read by nothing: they add a training
loss and leave the forward alone, and transformers' loss pools every layer's routing
statistics before multiplying them, where forja's `aux_loss_weight` weighs each layer's own
Switch loss -- set that in the run's config when training.
"""

from __future__ import annotations

import torch

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule, decoder_config
from forja.models.common.rope import ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.mixtral.model import MixtralArgs

ARCHITECTURES = ("MixtralForCausalLM",)
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need

# Options of other families that a Mixtral has no place for: when set (to other than
# their neutral value), the checkpoint is not one forja can run exactly as Mixtral.
_FOREIGN = {"attention_bias": False, "mlp_bias": False, "shared_expert_intermediate_size": 0,
            "n_shared_experts": 0, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
            "topk_method": "greedy", "norm_topk_prob": True}


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's Mixtral ({why})")


def _check_supported(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "its experts are SwiGLU, 'silu'")
    if cfg.get("router_jitter_noise", 0.0):
        raise _refuse("router_jitter_noise", cfg["router_jitter_noise"],
                      "forja's router adds no noise to its input; set it to 0.0")
    for key in ("rope_scaling", "rope_parameters"):  # 4.x and 5.x dialects
        scaling = cfg.get(key) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default" and kind not in ROPE_TYPES:
            raise _refuse(f"{key}.rope_type", kind, "'default', 'llama3' or 'yarn'")
    for key, neutral in _FOREIGN.items():
        if cfg.get(key, neutral) not in (neutral, None):
            raise _refuse(key, cfg[key], f"a Mixtral has no such option; it must be {neutral!r} or absent")


def args_from_config(cfg: dict) -> MixtralArgs:
    _check_supported(cfg)
    params = cfg.get("rope_parameters") or {}
    # Defaults where a key is absent are transformers' MixtralConfig's.
    return MixtralArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 4096 * 32),
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_scaling=rope_scaling_from_hf(cfg.get("rope_scaling") or params,
                                          cfg.get("max_position_embeddings", 4096 * 32)),
        sliding_window=cfg.get("sliding_window"),
        n_experts=cfg.get("num_local_experts", 8),
        top_k=cfg.get("num_experts_per_tok", 2),
        norm_topk_prob=True,
        score_func="softmax",
    )


def _uniform_kind(a: MixtralArgs) -> str:
    return "full_attention" if a.sliding_window is None else "sliding_attention"


def _check_exportable(a: MixtralArgs) -> None:
    """Refuse a forja Mixtral that transformers' MixtralForCausalLM cannot express."""
    problems = {
        "qk_norm": (a.qk_norm, "Mixtral's attention normalizes neither queries nor keys"),
        "layer_types": ({a.layer_type(i) for i in range(a.n_layers)} != {_uniform_kind(a)},
                        "Mixtral gives every block the same attention, over sliding_window if set"),
        "attention_sinks": (a.attention_sinks, "Mixtral's attention has no sinks"),
        "n_shared_experts": (a.n_shared_experts > 0, "Mixtral has no shared expert"),
        "score_func": (a.score_func != "softmax", "Mixtral's router is a softmax"),
        "norm_topk_prob": (not a.norm_topk_prob, "Mixtral always renormalizes the chosen experts' weights"),
        "route_scale": (a.route_scale != 1.0, "Mixtral does not scale routing weights"),
        "n_expert_groups": (a.n_expert_groups > 1, "Mixtral routes over all experts at once"),
        "expert_bias": (a.expert_bias, "Mixtral's router has no bias"),
        "capacity_factor": (a.capacity_factor > 0, "Mixtral drops no tokens"),
    }
    for field, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"a Mixtral with {field}={getattr(a, field)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def config_from_args(a: MixtralArgs) -> dict:
    _check_exportable(a)
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "mixtral",
        **decoder_config(a),
        "hidden_act": "silu",
        "sliding_window": a.sliding_window,
        "num_local_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "router_jitter_noise": 0.0,
        # The 4.x dialect: what the released Mixtral checkpoints use, and 5.x still reads.
        "rope_theta": a.rope_theta,
        "rope_scaling": None if a.rope_scaling is None else rope_scaling_to_hf(a.rope_scaling),
    }


_ATTENTION_AND_NORMS = [
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.k_proj.weight", "attention.wk.weight"),
    ("self_attn.v_proj.weight", "attention.wv.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
]
_PER_EXPERT = [  # slice e of forja's stacked tensor <- expert e's own tensor
    ("block_sparse_moe.experts.{e}.w1.weight", "feed_forward.experts.w1"),
    ("block_sparse_moe.experts.{e}.w3.weight", "feed_forward.experts.w3"),
    ("block_sparse_moe.experts.{e}.w2.weight", "feed_forward.experts.w2"),
]


def _split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(E, 2H, D), gate rows then up rows -> w1 (E, H, D), w3 (E, H, D)."""
    return tuple(p.contiguous() for p in t.chunk(2, dim=1))


def _join_gate_up(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat(ts, dim=1)


def _rules(a: MixtralArgs, fused_experts: bool) -> list[TensorRule]:
    hf, ours = "model.layers.{i}.", "layers.{i}."
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    out += [TensorRule(hf + h, (ours + f,)) for h, f in _ATTENTION_AND_NORMS]
    if fused_experts:
        experts = ours + "feed_forward.experts."
        out += [
            TensorRule(hf + "mlp.gate.weight", (ours + "feed_forward.router.gate.weight",)),
            TensorRule(hf + "mlp.experts.gate_up_proj", (experts + "w1", experts + "w3"),
                       to_forja=_split_gate_up, to_hf=_join_gate_up),
            TensorRule(hf + "mlp.experts.down_proj", (experts + "w2",)),
        ]
    else:
        out.append(TensorRule(hf + "block_sparse_moe.gate.weight", (ours + "feed_forward.router.gate.weight",)))
        out += [TensorRule(hf + h, (ours + f,), stacked=a.n_experts) for h, f in _PER_EXPERT]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


def rules(a: MixtralArgs) -> list[TensorRule]:
    """The released checkpoints' layout: `block_sparse_moe`, one tensor per expert."""
    return _rules(a, fused_experts=False)


def other_layouts(a: MixtralArgs) -> list[list[TensorRule]]:
    """transformers 5's module layout: `mlp`, fused experts."""
    return [_rules(a, fused_experts=True)]


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED,
                    other_layouts=other_layouts)
