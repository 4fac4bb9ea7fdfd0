"""Hugging Face `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` <-> forja Qwen3.5.

Reads the text model's config.json, or the published multimodal one
(`Qwen3_5ForConditionalGeneration`, its text model under `text_config`), and tensors named
`model.layers.*` or, as the published checkpoints hold them, `model.language_model.layers.*`
(the vision tower, `model.visual.*`, is not read). Layout differences from forja's:

- `self_attn.q_proj` holds each head's query then its output gate, (H, 2 hd, D) as rows:
  forja keeps them apart as attention.wq and attention.wg.
- `linear_attn.in_proj_qkv` and `linear_attn.conv1d` hold the Gated DeltaNet's q | k | v
  channels concatenated: forja keeps one projection and one convolution each, so tensor
  parallelism can shard them by head.
- Experts: one tensor per expert and projection in the published checkpoints, the fused
  `gate_up_proj` (E, 2H, D) / `down_proj` (E, D, H) in transformers 5's modules; both read,
  the per-expert one written (as forja/models/qwen3/hf.py).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from forja.errors import ForjaError
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.qwen3_5.model import Qwen3_5Args

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForConditionalGeneration")
IGNORED = (r"model\.visual\..*", r"mtp\..*")  # the vision tower; an MTP module config.json does not count


def refuse(key: str, value, why: str, family: str = "Qwen3.5") -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported by forja's {family} ({why})")


def text_config(cfg: dict) -> dict:
    """The text model's config: the whole file, or a multimodal file's `text_config`."""
    text = cfg.get("text_config")
    return {**text, "architectures": cfg.get("architectures")} if isinstance(text, dict) else cfg


def check_supported(cfg: dict, family: str = "Qwen3.5") -> None:
    if cfg.get("attention_bias"):
        raise refuse("attention_bias", True, "its attention has no biases", family)
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", cfg["hidden_act"], "its MLPs are SwiGLU, 'silu'", family)
    kinds = [t for t in cfg.get("layer_types") or [] if t not in ("full_attention", "linear_attention")]
    if kinds:
        raise refuse("layer_types", kinds[0], "each block is 'full_attention' or 'linear_attention'", family)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" and kind not in ROPE_TYPES:
        raise refuse("rope_parameters.rope_type", kind, "'default', 'llama3' or 'yarn' (of the rotating dims)", family)
    if cfg.get("router_jitter_noise"):
        raise refuse("router_jitter_noise", cfg["router_jitter_noise"], "the router has no noise", family)
    moe, shared = cfg.get("moe_intermediate_size"), cfg.get("shared_expert_intermediate_size")
    if cfg.get("num_experts") and shared and moe and shared % moe:
        raise refuse("shared_expert_intermediate_size", shared,
                     f"the shared expert must be a whole number of experts {moe} wide", family)


def common_args(cfg: dict) -> dict:
    """The fields Qwen3.5 and Qwen3-Next read alike from a (text) config.json."""
    rope = cfg.get("rope_parameters") or {}
    n_heads = cfg["num_attention_heads"]
    return dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn_dim=cfg.get("intermediate_size") or 0, vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 32768), norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # transformers' defaults where the file names none, as its config classes read them.
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        rope_scaling=rope_scaling_from_hf(rope or cfg.get("rope_scaling") or {}, cfg.get("max_position_embeddings", 32768)),
        layer_types=tuple(cfg.get("layer_types") or ()),
        full_attention_interval=cfg.get("full_attention_interval", 4),
        linear_n_k_heads=cfg.get("linear_num_key_heads", 16), linear_n_v_heads=cfg.get("linear_num_value_heads", 32),
        linear_k_head_dim=cfg.get("linear_key_head_dim", 128), linear_v_head_dim=cfg.get("linear_value_head_dim", 128),
        linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
    )


def moe_args(cfg: dict) -> dict:
    moe_dim = cfg.get("moe_intermediate_size", 512)
    shared = cfg.get("shared_expert_intermediate_size", 0) or 0
    return dict(n_experts=cfg.get("num_experts", 256), top_k=cfg.get("num_experts_per_tok", 8), moe_ffn_dim=moe_dim,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), score_func="softmax",
                n_shared_experts=shared // moe_dim, shared_expert_gate=shared > 0)


def _is_moe(cfg: dict) -> bool:
    return any("Moe" in a for a in cfg.get("architectures") or []) or cfg.get("model_type") == "qwen3_5_moe_text"


def mtp_depth(cfg: dict, family: str = "Qwen3.5") -> int:
    """The number of MTP modules config.json counts (`mtp_num_hidden_layers`), as forja runs them."""
    depth = cfg.get("mtp_num_hidden_layers") or 0
    if depth > 1:
        raise refuse("mtp_num_hidden_layers", depth, "its MTP layers share one fc and its norms; forja's "
                     "depths each have their own, and the published checkpoints hold one", family)
    if cfg.get("mtp_use_dedicated_embeddings"):
        raise refuse("mtp_use_dedicated_embeddings", True, "its MTP module reads the main model's embedding", family)
    return depth


def args_from_config(cfg: dict) -> Qwen3_5Args:
    cfg = text_config(cfg)
    check_supported(cfg)
    return Qwen3_5Args(**common_args(cfg), **(moe_args(cfg) if _is_moe(cfg) else {}), mtp_depth=mtp_depth(cfg))


def held_args(a: Qwen3_5Args, names: set[str]) -> Qwen3_5Args:
    """`a` without the MTP module when the checkpoint holds none of it (transformers saves
    none); when `mtp.fc` is stored the count holds, and a missing tensor is named."""
    if a.mtp_depth and "mtp.fc.weight" not in names:
        return dataclasses.replace(a, mtp_depth=0)
    return a


def check_exportable(a: Qwen3_5Args, family: str = "Qwen3.5") -> None:
    """Refuse a model transformers' classes cannot express."""
    problems = {
        "qk_norm": (a.qk_norm is False, "its attention always normalizes q and k"),
        "sliding_window": (a.sliding_window is not None, "export a model trained on the full context"),
        "attention_sinks": (a.attention_sinks, "its attention has no sinks"),
        "score_func": (a.score_func != "softmax", "its router is a softmax"),
        "norm_topk_prob": (a.n_experts > 0 and not a.norm_topk_prob and family == "Qwen3.5",
                           "Qwen3.5-MoE always renormalizes the top-k weights"),
        "route_scale": (a.route_scale != 1.0, "it does not scale routing weights"),
        "n_expert_groups": (a.n_expert_groups > 1, "it routes over all experts at once"),
        "expert_bias": (a.expert_bias, "its router has no bias"),
        "n_shared_experts": (a.n_experts > 0 and (a.n_shared_experts < 1) != (not a.shared_expert_gate),
                             "its shared expert always has its gate"),
    }
    for field, (bad, why) in problems.items():
        if bad:
            raise ForjaError(f"a {family} with {field}={getattr(a, field)!r} has no equivalent in transformers "
                             f"({why}); export a model trained without it")


def common_config(a: Qwen3_5Args) -> dict:
    cfg = {
        "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.ffn_dim,
        "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
        "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "layer_types": list(a.layer_types), "linear_conv_kernel_dim": a.linear_conv_kernel,
        "linear_key_head_dim": a.linear_k_head_dim, "linear_value_head_dim": a.linear_v_head_dim,
        "linear_num_key_heads": a.linear_n_k_heads, "linear_num_value_heads": a.linear_n_v_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                            "partial_rotary_factor": a.partial_rotary_factor,
                            **(rope_scaling_to_hf(a.rope_scaling) if a.rope_scaling is not None else {})},
    }
    if a.n_experts:
        cfg.update(num_experts=a.n_experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_ffn_dim,
                   shared_expert_intermediate_size=a.n_shared_experts * a.moe_ffn_dim,
                   norm_topk_prob=a.norm_topk_prob)
    return cfg


def check_mtp_exportable(a: Qwen3_5Args, family: str = "Qwen3.5") -> None:
    if a.mtp_depth > 1:
        raise ForjaError(f"a {family} with mtp_depth={a.mtp_depth} has no equivalent in its checkpoints (one "
                         "MTP module, whose layers share its fc and norms); export a model trained with depth 1 or 0")


def config_from_args(a: Qwen3_5Args) -> dict:
    check_exportable(a)
    check_mtp_exportable(a)
    moe = a.n_experts > 0
    return {"architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", **common_config(a),
            "mtp_num_hidden_layers": a.mtp_depth, "mtp_use_dedicated_embeddings": False}


# -- tensors ---------------------------------------------------------------------------------
def split_rows(sizes: list[int]):
    """HF's concatenated rows (or conv channels) -> forja's pieces, and back."""
    def to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p.contiguous() for p in t.split(sizes, dim=0))

    def to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(ts, dim=0)

    return to_forja, to_hf


def query_and_gate(head_dim: int):
    """q_proj's rows, (H, [query hd | gate hd], D) -> wq (H hd, D), wg (H hd, D), and back."""
    def to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        heads = t.view(-1, 2, head_dim, t.shape[-1])  # (H, 2, hd, D)
        return heads[:, 0].reshape(-1, t.shape[-1]).contiguous(), heads[:, 1].reshape(-1, t.shape[-1]).contiguous()

    def to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        q, g = (x.view(-1, head_dim, x.shape[-1]) for x in ts)  # (H, hd, D) each
        return torch.stack([q, g], dim=1).reshape(-1, q.shape[-1])

    return to_forja, to_hf


def attention_rules(a: Qwen3_5Args, hf: str, ours: str) -> list[TensorRule]:
    q_to_forja, q_to_hf = query_and_gate(a.head_dim)
    return [TensorRule(hf + "self_attn.q_proj.weight", (ours + "attention.wq.weight", ours + "attention.wg.weight"),
                       to_forja=q_to_forja, to_hf=q_to_hf)] + [
        TensorRule(hf + f"self_attn.{h}.weight", (ours + f"attention.{f}.weight",))
        for h, f in (("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo"), ("q_norm", "q_norm"), ("k_norm", "k_norm"))]


_LINEAR_SINGLE = (("in_proj_z.weight", "wz.weight"), ("in_proj_b.weight", "wb.weight"),
                  ("in_proj_a.weight", "wa.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
                  ("norm.weight", "norm.weight"), ("out_proj.weight", "wo.weight"))


def linear_attention_rules(a: Qwen3_5Args, hf: str, ours: str) -> list[TensorRule]:
    key, value = a.linear_n_k_heads * a.linear_k_head_dim, a.linear_n_v_heads * a.linear_v_head_dim
    to_forja, to_hf = split_rows([key, key, value])
    mixer = ours + "attention."
    return [
        TensorRule(hf + "linear_attn.in_proj_qkv.weight", tuple(mixer + f"{n}.weight" for n in ("wq", "wk", "wv")),
                   to_forja=to_forja, to_hf=to_hf),
        TensorRule(hf + "linear_attn.conv1d.weight", tuple(mixer + f"{n}.weight" for n in ("conv_q", "conv_k", "conv_v")),
                   to_forja=to_forja, to_hf=to_hf),
    ] + [TensorRule(hf + "linear_attn." + h, (mixer + f,)) for h, f in _LINEAR_SINGLE]


_DENSE_MLP = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def feed_forward_rules(a: Qwen3_5Args, hf: str, ours: str, fused_experts: bool,
                       layer: int | None = None) -> list[TensorRule]:
    """The feed-forward's rules of block `layer` (by default the index in `ours`, "layers.{i}.")."""
    ff = ours + "feed_forward."
    if not a.is_moe_layer(int(ours.split(".")[1]) if layer is None else layer):
        return [TensorRule(hf + f"mlp.{h}.weight", (ff + f"{f}.weight",)) for h, f in _DENSE_MLP]
    out = [TensorRule(hf + "mlp.gate.weight", (ff + "router.gate.weight",))]
    if a.n_shared_experts:
        out += [TensorRule(hf + f"mlp.shared_expert.{h}.weight", (ff + f"shared_experts.{f}.weight",))
                for h, f in _DENSE_MLP]
        out.append(TensorRule(hf + "mlp.shared_expert_gate.weight", (ff + "shared_gate.weight",)))
    experts = ff + "experts."
    if fused_experts:
        return out + [
            TensorRule(hf + "mlp.experts.gate_up_proj", (experts + "w1", experts + "w3"),
                       to_forja=lambda t: tuple(p.contiguous() for p in t.chunk(2, dim=1)),
                       to_hf=lambda ts: torch.cat(ts, dim=1)),
            TensorRule(hf + "mlp.experts.down_proj", (experts + "w2",)),
        ]
    return out + [TensorRule(hf + f"mlp.experts.{{e}}.{h}.weight", (experts + f,), stacked=a.n_experts)
                  for h, f in _DENSE_MLP]


def layer_rules(a: Qwen3_5Args, i: int, fused_experts: bool, linear=linear_attention_rules) -> list[TensorRule]:
    """Block i's rules; `linear`: the Gated DeltaNet's (Qwen3-Next fuses its projections otherwise)."""
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    mixer = linear if a.layer_type(i) == "linear_attention" else attention_rules
    norms = [TensorRule(hf + "input_layernorm.weight", (ours + "attention_norm.weight",)),
             TensorRule(hf + "post_attention_layernorm.weight", (ours + "ffn_norm.weight",))]
    return mixer(a, hf, ours) + norms + feed_forward_rules(a, hf, ours, fused_experts)


def model_rules(a: Qwen3_5Args, fused_experts: bool, linear=linear_attention_rules) -> list[TensorRule]:
    out = [TensorRule("model.embed_tokens.weight", ("tok_embeddings.weight",)),
           TensorRule("model.norm.weight", ("norm.weight",))]
    for i in range(a.n_layers):
        out += layer_rules(a, i, fused_experts, linear)
    if not a.tie_embeddings:
        out.append(TensorRule("lm_head.weight", ("output.weight",)))
    return out


_MTP_OWN = (("fc", "proj"), ("pre_fc_norm_hidden", "hnorm"), ("pre_fc_norm_embedding", "enorm"), ("norm", "norm"))


def mtp_rules(a: Qwen3_5Args, fused_experts: bool) -> list[TensorRule]:
    """The MTP module (mtp_depth 1): `mtp.fc`, `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding`,
    `mtp.norm` and `mtp.layers.0.*`, a full-attention block whose feed-forward is block 0's
    kind, as forja's mtp.layers.{n_layers} (Qwen3_5.build_mtp)."""
    if not a.mtp_depth:
        return []
    i = a.n_layers
    ours, block = f"mtp.layers.{i}.", f"mtp.layers.{i}.block."
    out = [TensorRule(f"mtp.{h}.weight", (ours + f"{f}.weight",)) for h, f in _MTP_OWN]
    out += attention_rules(a, "mtp.layers.0.", block)
    out += [TensorRule("mtp.layers.0.input_layernorm.weight", (block + "attention_norm.weight",)),
            TensorRule("mtp.layers.0.post_attention_layernorm.weight", (block + "ffn_norm.weight",))]
    return out + feed_forward_rules(a, "mtp.layers.0.", block, fused_experts, layer=0)


def rules(a: Qwen3_5Args) -> list[TensorRule]:
    """The published layout: one tensor per expert, the MTP module when counted."""
    return model_rules(a, fused_experts=False) + mtp_rules(a, fused_experts=False)


def other_layouts(a: Qwen3_5Args) -> list[list[TensorRule]]:
    """transformers 5's fused experts, for an MoE model."""
    return [model_rules(a, fused_experts=True) + mtp_rules(a, fused_experts=True)] if a.n_experts else []


def normalize_name(name: str) -> str:
    """The multimodal checkpoints' text model, `model.language_model.*`, as `model.*`."""
    return re.sub(r"^model\.language_model\.", "model.", name)


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED,
                    normalize_name=normalize_name, other_layouts=other_layouts, held_args=held_args)
