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

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.mixtral.model import MixtralArgs

ARCHITECTURES = ("MixtralForCausalLM",)
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need

_refuse = hf_rules.refusal("Mixtral")
_SUPPORTED = [
    hf_rules.activation("silu", "its experts are SwiGLU, 'silu'"),
    hf_rules.Unsupported("router_jitter_noise", lambda v: not v,
                         "forja's router adds no noise to its input; set it to 0.0"),
]
# Options of other families that a Mixtral has no place for: when set (to other than
# their neutral value), the checkpoint is not one forja can run exactly as Mixtral.
_FOREIGN = hf_rules.neutral({"attention_bias": False, "mlp_bias": False, "shared_expert_intermediate_size": 0,
                    "n_shared_experts": 0, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
                    "topk_method": "greedy", "norm_topk_prob": True}, "a Mixtral")


def args_from_config(cfg: dict) -> MixtralArgs:
    hf_rules.check_config(cfg, _SUPPORTED, _refuse)
    hf_rules.check_rope_types(cfg, _refuse)
    hf_rules.check_config(cfg, _FOREIGN, _refuse)
    # Defaults where a key is absent are transformers' MixtralConfig's.
    args = hf_rules.decoder_args(cfg, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5)
    return MixtralArgs(**args, **hf_rules.rope_args(cfg, args["max_seq_len"], 1_000_000.0),
                       sliding_window=cfg.get("sliding_window"), n_experts=cfg.get("num_local_experts", 8),
                       top_k=cfg.get("num_experts_per_tok", 2), norm_topk_prob=True, score_func="softmax")


def _uniform_kind(a: MixtralArgs) -> str:
    return "full_attention" if a.sliding_window is None else "sliding_attention"


def config_from_args(a: MixtralArgs) -> dict:
    hf_rules.check_exportable(a, "a Mixtral", {
        "qk_norm": (a.qk_norm, "Mixtral's attention normalizes neither queries nor keys"),
        "layer_types": ({a.layer_type(i) for i in range(a.n_layers)} != {_uniform_kind(a)},
                        "Mixtral gives every block the same attention, over sliding_window if set"),
        "attention_sinks": (a.attention_sinks, "Mixtral's attention has no sinks"),
        "n_shared_experts": (a.n_shared_experts > 0, "Mixtral has no shared expert"),
        "norm_topk_prob": (not a.norm_topk_prob, "Mixtral always renormalizes the chosen experts' weights"),
        **hf_rules.router_problems(a, "Mixtral", "Mixtral's"),
        "capacity_factor": (a.capacity_factor > 0, "Mixtral drops no tokens"),
    })
    return {"architectures": list(ARCHITECTURES), "model_type": "mixtral", **hf_rules.decoder_config(a),
            "hidden_act": "silu", "sliding_window": a.sliding_window, "num_local_experts": a.n_experts,
            "num_experts_per_tok": a.top_k, "router_jitter_noise": 0.0, **hf_rules.rope_config(a)}


_ATTENTION_AND_NORMS = hf_rules.renamed([*hf_rules.attention_pairs(), *hf_rules.NORM_PAIRS["pre"]])
_PER_EXPERT = (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))  # gate, up, down


def _rules(a: MixtralArgs, fused_experts: bool) -> list[TensorRule]:
    hf, ours = "model.layers.{i}." + ("mlp." if fused_experts else "block_sparse_moe."), "layers.{i}.feed_forward."
    moe = [TensorRule(hf + "gate.weight", (ours + "router.gate.weight",)),
           *hf_rules.expert_rules(a, hf, ours, fused=fused_experts, names=_PER_EXPERT)]
    return hf_rules.decoder_rules(a, _ATTENTION_AND_NORMS + moe)


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    **hf_rules.expert_layouts(_rules))
