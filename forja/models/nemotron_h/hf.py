"""Hugging Face `NemotronHForCausalLM` <-> forja Nemotron-H.

config.json is read as transformers 5.x's NemotronHConfig reads it: the blocks from
`layers_block_type` (or `layer_types`; 'linear_attention' is Mamba-2, 'full_attention',
'mlp', 'moe'), or from the older `hybrid_override_pattern` string (M, *, -, E); the Mamba-2
keys under either spelling (`n_groups` or `mamba_n_groups`, `conv_kernel` or `mamba_d_conv`,
`chunk_size` or `mamba_chunk_size`, `time_step_limit` or `mamba_dt_limit`, ...), the config
class's defaults where absent. A mixture-of-experts block (Nemotron 3) reads `n_routed_experts`
(or `num_local_experts`), `num_experts_per_tok`, `moe_intermediate_size`,
`moe_shared_expert_intermediate_size` (its one shared expert's width), `n_group`, `topk_group`,
`norm_topk_prob`, `routed_scaling_factor` and `moe_latent_size` (Nemotron 3 Super: the routed
experts compute in that width, `mixer.fc1_latent_proj` and `fc2_latent_proj` around them, as
forja's feed_forward.to_latent and from_latent); the router is always sigmoid scores with the
correction bias, groups scored by their best two. Refused: an activation other than squared
ReLU in the MLPs and experts or SiLU in Mamba-2, attention dropout. Ignored as transformers ignores them:
`attention_bias` (its attention has no biases whatever the key says), `tie_word_embeddings`
(its lm_head is never tied: a checkpoint holds both matrices, and forja keeps both),
`residual_in_fp32`, `n_shared_experts` and `moe_shared_expert_overlap` (there is always one
shared expert), the multi-token prediction layers (`mtp.*` tensors).

Tensors: the published checkpoints and transformers' save_pretrained name the model
`backbone.` (transformers renames it `model.` on load; both are read, `backbone.` written).
A Mamba-2 block's `mixer.in_proj` holds the rows z | x | B | C | dt and `mixer.conv1d` the
channels x | B | C, which forja keeps as separate projections and convolutions; every block's
one norm is `norm`. An MoE block's experts are one tensor per expert and projection
(`mixer.experts.{e}.up_proj.weight`, the published layout, which forja writes) stacked into
experts.w1 (E, H, D) and w2 (E, D, H); transformers 5's fused `mixer.experts.up_proj` and
`down_proj` (save_pretrained(save_original_format=False)) load too. The router's
`mixer.gate.weight` and `e_score_correction_bias` are its gate and expert_bias.
"""

from __future__ import annotations

import math

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule, split_rows
from forja.models.nemotron_h.model import NemotronHArgs, nemotron_h_layer_types

ARCHITECTURES = ("NemotronHForCausalLM",)
IGNORED = (r"mtp\..*",)  # transformers builds no multi-token prediction module either
_refuse = hf_rules.refusal("Nemotron-H")
_SUPPORTED = [hf_rules.activation("relu2", "its MLPs and experts square a ReLU", key="mlp_hidden_act"),
              hf_rules.activation("silu", "its Mamba-2 convolutions use 'silu'", key="mamba_hidden_act"),
              hf_rules.NO_ATTENTION_DROPOUT]
_HF_KINDS = {"linear_attention": "mamba2", "full_attention": "full_attention", "mlp": "mlp", "moe": "moe"}
_FORJA_KINDS = {v: k for k, v in _HF_KINDS.items()}
# args field -> (config.json key, its older spelling, NemotronHConfig's default)
_MAMBA = {"mamba_n_heads": ("mamba_num_heads", None, 128), "mamba_head_dim": ("mamba_head_dim", None, 64),
          "mamba_n_groups": ("n_groups", "mamba_n_groups", 8), "mamba_state_size": ("ssm_state_size", None, 128),
          "mamba_conv_kernel": ("conv_kernel", "mamba_d_conv", 4),
          "mamba_chunk_size": ("chunk_size", "mamba_chunk_size", 128),
          "mamba_dt_min": ("time_step_min", "mamba_dt_min", 0.001),
          "mamba_dt_max": ("time_step_max", "mamba_dt_max", 0.1),
          "mamba_dt_floor": ("time_step_floor", "mamba_dt_init_floor", 1e-4),
          "mamba_conv_bias": ("use_conv_bias", "mamba_conv_bias", True), "mamba_bias": ("use_bias", None, False)}
# args field -> (config.json key, another spelling, NemotronHConfig's default), read when a block is 'moe'
_MOE = {"n_experts": ("n_routed_experts", "num_local_experts", 8), "top_k": ("num_experts_per_tok", None, 2),
        "moe_ffn_dim": ("moe_intermediate_size", None, 7688),
        "shared_ffn_dim": ("moe_shared_expert_intermediate_size", None, 7688),
        "norm_topk_prob": ("norm_topk_prob", None, True), "route_scale": ("routed_scaling_factor", None, 1.0),
        "n_expert_groups": ("n_group", None, 1), "topk_groups": ("topk_group", None, 1)}


def _float(v) -> float:
    """A config.json number; transformers writes a non-finite one as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def _get(cfg: dict, key: str, old: str | None, default):
    if cfg.get(key) is not None:
        return cfg[key]
    return cfg[old] if old is not None and cfg.get(old) is not None else default


def _layer_types(cfg: dict) -> tuple[str, ...]:
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not kinds:
        if cfg.get("hybrid_override_pattern"):
            return nemotron_h_layer_types(cfg["hybrid_override_pattern"])
        kinds = ["linear_attention", "moe", "full_attention", "mlp"]  # NemotronHConfig's default
    for kind in kinds:
        if kind not in _HF_KINDS:
            raise _refuse("layers_block_type", kind, "each block must be 'linear_attention' (Mamba-2), "
                          "'full_attention', 'mlp' or 'moe'")
    return tuple(_HF_KINDS[k] for k in kinds)


def _moe_args(cfg: dict, kinds: tuple[str, ...]) -> dict:
    """The mixture-of-experts fields, when a block is 'moe' (else none: a dense model)."""
    if "moe" not in kinds:
        return {}
    out = {field: _get(cfg, key, old, default) for field, (key, old, default) in _MOE.items()}
    return {**out, "norm_topk_prob": bool(out["norm_topk_prob"]), "route_scale": float(out["route_scale"]),
            "moe_latent_dim": cfg.get("moe_latent_size") or 0}  # null: the experts at the model's width


def args_from_config(cfg: dict) -> NemotronHArgs:
    hf_rules.check_config(cfg, _SUPPORTED, _refuse)
    kinds = _layer_types(cfg)
    dim, heads = cfg.get("hidden_size", 4096), cfg.get("num_attention_heads", 32)
    limit = _get(cfg, "time_step_limit", "mamba_dt_limit", (0.0, math.inf))
    return NemotronHArgs(
        dim=dim, n_layers=len(kinds), n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or dim // heads, ffn_dim=cfg.get("intermediate_size", 21504),
        vocab_size=cfg.get("vocab_size", 131072), max_seq_len=cfg.get("max_position_embeddings") or 4096,
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5), tie_embeddings=False,  # transformers never ties them
        layer_types=kinds, mlp_bias=bool(cfg.get("mlp_bias", False)), mamba_dt_limit=tuple(_float(v) for v in limit),
        **{field: _get(cfg, key, old, default) for field, (key, old, default) in _MAMBA.items()},
        **_moe_args(cfg, kinds))


def _moe_config(a: NemotronHArgs) -> dict:
    """The mixture-of-experts keys (none for a dense model); refuses what transformers' router cannot express."""
    if not a.n_experts:
        return {}
    hf_rules.check_exportable(a, "a Nemotron-H", {
        "score_func": (a.score_func != "sigmoid", "its router scores by sigmoids"),
        "expert_bias": (not a.expert_bias, "its router always has the correction bias"),
        "group_score": (a.n_expert_groups > 1 and a.group_score != "top2_sum", "its groups score their best two"),
        "n_shared_experts": (a.n_shared_experts != 1, "it has one shared expert (of any width: shared_ffn_dim)"),
        "router_bias": (a.router_bias, "its router's projection has no bias"),
        "expert_proj_bias": (a.expert_proj_bias, "its routed experts have no biases"),
        "scale_expert_input": (a.scale_expert_input, "it weighs the experts' outputs"),
        "capacity_factor": (a.capacity_factor > 0, "it drops no tokens"),
    })
    values = {field: getattr(a, field) for field in _MOE}
    values["shared_ffn_dim"] = a.shared_width
    return {"n_shared_experts": 1, "moe_latent_size": a.moe_latent_dim or None,
            **{key: values[field] for field, (key, _, _) in _MOE.items()}}


def config_from_args(a: NemotronHArgs) -> dict:
    hf_rules.check_exportable(a, "a Nemotron-H", {
        "mtp_depth": (a.mtp_depth > 0, "transformers' Nemotron-H builds no multi-token prediction module"),
        "tie_embeddings": (a.tie_embeddings, "transformers' Nemotron-H never ties its lm_head to the embedding"),
    })
    return {"architectures": list(ARCHITECTURES), "model_type": "nemotron_h", "hidden_size": a.dim,
            "layers_block_type": [_FORJA_KINDS[k] for k in a.layer_types], "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.ffn_dim,
            "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len, "layer_norm_epsilon": a.norm_eps,
            "tie_word_embeddings": False, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
            "mlp_bias": a.mlp_bias, "attention_bias": False,
            "time_step_limit": list(a.mamba_dt_limit),  # Infinity in config.json, as Python writes it
            **{key: getattr(a, field) for field, (key, _, _) in _MAMBA.items()}, **_moe_config(a)}


# -- tensors ---------------------------------------------------------------------------------
def _mamba_rules(a: NemotronHArgs, hf: str, ours: str) -> list[TensorRule]:
    inner, bc = a.mamba_n_heads * a.mamba_head_dim, a.mamba_n_groups * a.mamba_state_size
    proj_to_forja, proj_to_hf = split_rows([inner, inner, bc, bc, a.mamba_n_heads])
    conv_to_forja, conv_to_hf = split_rows([inner, bc, bc])
    projs = ("wz", "wx", "wB", "wC", "wdt")
    convs = ("conv_x", "conv_B", "conv_C")
    params = ["weight"] + (["bias"] if a.mamba_bias else [])
    out = [TensorRule(f"{hf}in_proj.{p}", tuple(f"{ours}{n}.{p}" for n in projs), to_forja=proj_to_forja,
                      to_hf=proj_to_hf) for p in params]
    out += [TensorRule(f"{hf}conv1d.{p}", tuple(f"{ours}{n}.{p}" for n in convs), to_forja=conv_to_forja,
                       to_hf=conv_to_hf) for p in ["weight"] + (["bias"] if a.mamba_conv_bias else [])]
    singles = [("A_log", "A_log"), ("D", "D"), ("dt_bias", "dt_bias"), ("norm.weight", "norm.weight")]
    singles += [(f"out_proj.{p}", f"wo.{p}") for p in params]
    return out + hf_rules.renamed(singles, hf, ours)


_UP_DOWN = (("up_proj", "w1"), ("down_proj", "w2"))  # a squared-ReLU MLP's or expert's projections


def _moe_rules(a: NemotronHArgs, hf: str, ours: str, fused: bool) -> list[TensorRule]:
    """An MoE block's mixer `hf` ("backbone.layers.{i}.mixer.") as forja's feed_forward `ours`."""
    pairs = [("gate.weight", "router.gate.weight"), ("gate.e_score_correction_bias", "router.expert_bias")]
    biased = ["weight"] + (["bias"] if a.mlp_bias else [])
    pairs += [(f"shared_experts.{h}.{p}", f"shared_experts.{f}.{p}") for h, f in _UP_DOWN for p in biased]
    if a.moe_latent_dim:  # Nemotron 3 Super's projections around the routed experts
        pairs += [(f"{h}_latent_proj.{p}", f"{f}.{p}") for h, f in (("fc1", "to_latent"), ("fc2", "from_latent"))
                  for p in biased]
    experts = ours + "experts."
    if fused:  # transformers 5's modules: one (E, H, D) up and one (E, D, H) down tensor per layer
        routed = [TensorRule(hf + "experts.up_proj", (experts + "w1",)),
                  TensorRule(hf + "experts.down_proj", (experts + "w2",))]
    else:
        routed = hf_rules.expert_rules(a, hf, ours, fused=False, names=_UP_DOWN)
    return hf_rules.renamed(pairs, hf, ours) + routed


def layer_rules(a: NemotronHArgs, i: int, fused: bool = False) -> list[TensorRule]:
    hf, ours = f"backbone.layers.{i}.", f"layers.{i}."
    kind = a.layer_type(i)
    if kind == "moe":
        return hf_rules.renamed([("norm.weight", "ffn_norm.weight")], hf, ours) + \
            _moe_rules(a, hf + "mixer.", ours + "feed_forward.", fused)
    if kind == "mlp":
        pairs = [(f"mixer.{h}.{p}", f"feed_forward.{f}.{p}") for h, f in (("up_proj", "w1"), ("down_proj", "w2"))
                 for p in ["weight"] + (["bias"] if a.mlp_bias else [])]
        return hf_rules.renamed([("norm.weight", "ffn_norm.weight"), *pairs], hf, ours)
    out = hf_rules.renamed([("norm.weight", "attention_norm.weight")], hf, ours)
    if kind == "mamba2":
        return out + _mamba_rules(a, hf + "mixer.", ours + "attention.")
    pairs = [(f"mixer.{p}_proj.weight", f"attention.w{p}.weight") for p in "qkvo"]
    return out + hf_rules.renamed(pairs, hf, ours)


def _rules(a: NemotronHArgs, fused: bool) -> list[TensorRule]:
    out = [TensorRule("backbone.embeddings.weight", ("tok_embeddings.weight",)),
           TensorRule("backbone.norm_f.weight", ("norm.weight",))]
    out += [r for i in range(a.n_layers) for r in layer_rules(a, i, fused)]
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


def normalize_name(name: str) -> str:
    """transformers' module prefix `model.` as the on-disk `backbone.`."""
    return "backbone." + name[len("model."):] if name.startswith("model.") else name


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED, normalize_name=normalize_name,
                    **hf_rules.expert_layouts(_rules))
