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

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import ROPE_NAMES, ROPE_TYPES, Scaling, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.olmo3.model import Olmo3Args, olmo3_layer_types

ARCHITECTURES = ("Olmo3ForCausalLM",)
IGNORED: tuple[str, ...] = ()

_DEFAULT_THETA = 500_000.0  # Olmo3Config.default_theta
_refuse = hf_rules.refusal("OLMo 3")
_SUPPORTED = [hf_rules.no_attention_bias("OLMo 3's projections have no biases"),
              hf_rules.activation("silu", "its MLPs are SwiGLU, 'silu'"), hf_rules.NO_ATTENTION_DROPOUT]


def _kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _scaling(rope: dict, max_len: int) -> Scaling | None:
    """The full-attention blocks' frequency scaling (common/rope.py reads each kind)."""
    kind = _kind(rope)
    if kind != "default" and kind not in ROPE_TYPES:
        raise _refuse("rope_scaling.rope_type", kind, f"forja's OLMo 3 reads {ROPE_NAMES}")
    return rope_scaling_from_hf(rope, max_len)


def args_from_config(cfg: dict) -> Olmo3Args:
    hf_rules.check_config(cfg, _SUPPORTED, _refuse)
    # transformers 5.24 takes rope_theta for the full blocks only: the sliding ones keep the default.
    ropes = hf_rules.rope_by_layer_type(cfg, _refuse, "OLMo 3", _DEFAULT_THETA, _DEFAULT_THETA)
    if _kind(ropes["sliding_attention"]) != "default":
        raise _refuse("rope_parameters.sliding_attention.rope_type", _kind(ropes["sliding_attention"]),
                      "forja scales the full-attention blocks' frequencies only; 'default'")
    # transformers' defaults where a key is absent, as its Olmo3Config reads them.
    args = hf_rules.decoder_args(cfg, rms_norm_eps=1e-5)
    return Olmo3Args(**args, sliding_window=cfg.get("sliding_window", 4096),
                     layer_types=tuple(cfg.get("layer_types") or olmo3_layer_types(args["n_layers"])),
                     rope_theta=float(ropes["full_attention"]["rope_theta"]),
                     local_rope_theta=float(ropes["sliding_attention"]["rope_theta"]),
                     rope_scaling=_scaling(ropes["full_attention"], args["max_seq_len"]))


def check_exportable(a: Olmo3Args, version: int) -> None:
    """What transformers' OLMo `version` (2 or 3) cannot hold, refused in one sentence."""
    name = f"OLMo {version}"
    hf_rules.check_exportable(a, f"an {name}", {
        "qk_norm": (not a.qk_norm, f"transformers' {name} always normalizes q and k"),
        "attention_sinks": (a.attention_sinks, f"{name}'s attention has no sinks"),
        "head_dim": (a.head_dim * a.n_heads != a.dim, f"transformers' Olmo{version}Config derives it as dim / n_heads"),
        "mtp_depth": (a.mtp_depth > 0, f"{name} has no multi-token prediction"),
    })


def config_from_args(a: Olmo3Args) -> dict:
    check_exportable(a, 3)
    full = {"rope_type": "default"} if a.rope_scaling is None else rope_scaling_to_hf(a.rope_scaling)
    windows = hf_rules.layer_types_config(a, {**full, "rope_theta": a.rope_theta}, a.local_rope_theta)
    cfg = {"architectures": list(ARCHITECTURES), "model_type": "olmo3", **hf_rules.decoder_config(a),
           "hidden_act": "silu", "attention_bias": False, **windows}
    del cfg["head_dim"]  # transformers' Olmo3Config has none: dim / n_heads
    return cfg


def rules(a: Olmo3Args) -> list[TensorRule]:
    """OLMo 2's and 3's tensors: whole-projection QK-norms, post-norms, SwiGLU."""
    layer = [*hf_rules.attention_pairs(qk_norm=True), *hf_rules.NORM_PAIRS["post"], *hf_rules.MLP_PAIRS]
    return hf_rules.decoder_rules(a, hf_rules.renamed(layer))


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
