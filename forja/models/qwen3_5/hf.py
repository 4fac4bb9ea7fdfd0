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
from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.common.rope import ROPE_NAMES, ROPE_TYPES, rope_scaling_from_hf, rope_scaling_to_hf
from forja.models.qwen3_5.model import Qwen3_5Args

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForConditionalGeneration")
IGNORED = (r"model\.visual\..*", r"mtp\..*")  # the vision tower; an MTP module config.json does not count
_SUPPORTED = [hf_rules.no_attention_bias("its attention has no biases"),
              hf_rules.activation("silu", "its MLPs are SwiGLU, 'silu'")]
_NO_JITTER = [hf_rules.Unsupported("router_jitter_noise", lambda v: not v, "the router has no noise")]


def text_config(cfg: dict) -> dict:
    """The text model's config: the whole file, or a multimodal file's `text_config`."""
    text = cfg.get("text_config")
    return {**text, "architectures": cfg.get("architectures")} if isinstance(text, dict) else cfg


def check_supported(cfg: dict, family: str = "Qwen3.5") -> None:
    refuse = hf_rules.refusal(family)
    hf_rules.check_config(cfg, _SUPPORTED, refuse)
    hf_rules.check_linear_layer_types(cfg, refuse)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" and kind not in ROPE_TYPES:
        raise refuse("rope_parameters.rope_type", kind, f"{ROPE_NAMES} (of the rotating dims)")
    hf_rules.check_config(cfg, _NO_JITTER, refuse)


def common_args(cfg: dict) -> dict:
    """The fields Qwen3.5 and Qwen3-Next read alike from a (text) config.json."""
    rope = cfg.get("rope_parameters") or {}
    args = hf_rules.decoder_args(cfg, intermediate_size=0, max_position_embeddings=32768)
    return dict(
        **args, **hf_rules.linear_attention_args(cfg),
        # transformers' defaults where the file names none, as its config classes read them.
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
        rope_scaling=rope_scaling_from_hf(rope or cfg.get("rope_scaling") or {}, args["max_seq_len"]),
        layer_types=tuple(cfg.get("layer_types") or ()), full_attention_interval=cfg.get("full_attention_interval", 4),
    )


def moe_args(cfg: dict) -> dict:
    moe_dim = cfg.get("moe_intermediate_size", 512)
    shared = cfg.get("shared_expert_intermediate_size", 0) or 0
    # A whole number of experts wide is counted in experts (as the flavors are); any other
    # width is one shared expert of its own width.
    n_shared, width = (shared // moe_dim, 0) if shared % moe_dim == 0 else (1, shared)
    return dict(n_experts=cfg.get("num_experts", 256), top_k=cfg.get("num_experts_per_tok", 8), moe_ffn_dim=moe_dim,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), score_func="softmax",
                n_shared_experts=n_shared, shared_ffn_dim=width, shared_expert_gate=shared > 0)


def _is_moe(cfg: dict) -> bool:
    return any("Moe" in a for a in cfg.get("architectures") or []) or cfg.get("model_type") == "qwen3_5_moe_text"


def mtp_depth(cfg: dict, family: str = "Qwen3.5") -> int:
    """The number of MTP modules config.json counts (`mtp_num_hidden_layers`), as forja runs them."""
    refuse = hf_rules.refusal(family)
    depth = cfg.get("mtp_num_hidden_layers") or 0
    if depth > 1:
        raise refuse("mtp_num_hidden_layers", depth, "its MTP layers share one fc and its norms; forja's "
                     "depths each have their own, and the published checkpoints hold one")
    if cfg.get("mtp_use_dedicated_embeddings"):
        raise refuse("mtp_use_dedicated_embeddings", True, "its MTP module reads the main model's embedding")
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


def check_exportable_as(a: Qwen3_5Args, family: str = "Qwen3.5") -> None:
    """Refuse a model transformers' classes cannot express."""
    hf_rules.check_exportable(a, f"a {family}", {
        "qk_norm": (a.qk_norm is False, "its attention always normalizes q and k"),
        "sliding_window": (a.sliding_window is not None, "export a model trained on the full context"),
        "attention_sinks": (a.attention_sinks, "its attention has no sinks"),
        **hf_rules.router_problems(a, "it", "its"),
        "norm_topk_prob": (a.n_experts > 0 and not a.norm_topk_prob and family == "Qwen3.5",
                           "Qwen3.5-MoE always renormalizes the top-k weights"),
        "n_shared_experts": (a.n_experts > 0 and (a.n_shared_experts < 1) != (not a.shared_expert_gate),
                             "its shared expert always has its gate"),
    })
    if a.mtp_depth > 1:
        raise ForjaError(f"a {family} with mtp_depth={a.mtp_depth} has no equivalent in its checkpoints (one "
                         "MTP module, whose layers share its fc and norms); export a model trained with depth 1 or 0")


def common_config(a: Qwen3_5Args) -> dict:
    cfg = {**hf_rules.decoder_config(a), "hidden_act": "silu", "attention_bias": False,
           **hf_rules.linear_attention_config(a),
           "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                               "partial_rotary_factor": a.partial_rotary_factor,
                               **(rope_scaling_to_hf(a.rope_scaling) if a.rope_scaling is not None else {})},
           "mtp_num_hidden_layers": a.mtp_depth, "mtp_use_dedicated_embeddings": False}
    if a.n_experts:
        cfg.update(num_experts=a.n_experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_ffn_dim,
                   shared_expert_intermediate_size=a.shared_width,
                   norm_topk_prob=a.norm_topk_prob)
    return cfg


def config_from_args(a: Qwen3_5Args) -> dict:
    check_exportable_as(a)
    moe = a.n_experts > 0
    return {"architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", **common_config(a)}


# -- tensors ---------------------------------------------------------------------------------
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
    others = hf_rules.attention_pairs(qk_norm=True)[1:]  # k, v, o, the norms
    return [TensorRule(hf + "self_attn.q_proj.weight", (ours + "attention.wq.weight", ours + "attention.wg.weight"),
                       to_forja=q_to_forja, to_hf=q_to_hf)] + hf_rules.renamed(others, hf, ours)


_LINEAR_SINGLE = (("in_proj_z.weight", "wz.weight"), ("in_proj_b.weight", "wb.weight"),
                  ("in_proj_a.weight", "wa.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
                  ("norm.weight", "norm.weight"), ("out_proj.weight", "wo.weight"))


def linear_attention_rules(a: Qwen3_5Args, hf: str, ours: str) -> list[TensorRule]:
    key, value = a.linear_n_k_heads * a.linear_k_head_dim, a.linear_n_v_heads * a.linear_v_head_dim
    to_forja, to_hf = hf_rules.split_rows([key, key, value])
    mixer, lin = ours + "attention.", hf + "linear_attn."
    return [
        TensorRule(lin + "in_proj_qkv.weight", tuple(mixer + f"{n}.weight" for n in ("wq", "wk", "wv")),
                   to_forja=to_forja, to_hf=to_hf),
        TensorRule(lin + "conv1d.weight", tuple(mixer + f"{n}.weight" for n in ("conv_q", "conv_k", "conv_v")),
                   to_forja=to_forja, to_hf=to_hf),
    ] + hf_rules.renamed(_LINEAR_SINGLE, lin, mixer)


def feed_forward_rules(a: Qwen3_5Args, hf: str, ours: str, fused_experts: bool, layer: int) -> list[TensorRule]:
    """The feed-forward's rules of a block with block `layer`'s kind of feed-forward."""
    if not a.is_moe_layer(layer):
        return hf_rules.renamed(hf_rules.MLP_PAIRS, hf, ours)
    hf, ff = hf + "mlp.", ours + "feed_forward."
    out = [TensorRule(hf + "gate.weight", (ff + "router.gate.weight",))]
    if a.n_shared_experts:
        out += hf_rules.renamed(hf_rules.SWIGLU_PAIRS, hf + "shared_expert.", ff + "shared_experts.")
        out.append(TensorRule(hf + "shared_expert_gate.weight", (ff + "shared_gate.weight",)))
    return out + hf_rules.expert_rules(a, hf, ff, fused=fused_experts)


def block_rules(a: Qwen3_5Args, hf: str, ours: str, mixer, layer: int, fused_experts: bool) -> list[TensorRule]:
    """A block's rules under the prefixes `hf` and `ours`: its sequence mixer's (`mixer`), its
    norms, and its feed-forward, that of block `layer`'s kind."""
    norms = hf_rules.renamed(hf_rules.NORM_PAIRS["pre"], hf, ours)
    return mixer(a, hf, ours) + norms + feed_forward_rules(a, hf, ours, fused_experts, layer)


def layer_rules(a: Qwen3_5Args, i: int, fused_experts: bool, linear=linear_attention_rules) -> list[TensorRule]:
    """Block i's rules; `linear`: the Gated DeltaNet's (Qwen3-Next fuses its projections otherwise)."""
    mixer = linear if a.layer_type(i) == "linear_attention" else attention_rules
    return block_rules(a, f"model.layers.{i}.", f"layers.{i}.", mixer, i, fused_experts)


def model_rules(a: Qwen3_5Args, fused_experts: bool, linear=linear_attention_rules) -> list[TensorRule]:
    return hf_rules.decoder_rules(a, lambda i: layer_rules(a, i, fused_experts, linear))


_MTP_OWN = (("fc.weight", "proj.weight"), ("pre_fc_norm_hidden.weight", "hnorm.weight"),
            ("pre_fc_norm_embedding.weight", "enorm.weight"), ("norm.weight", "norm.weight"))


def mtp_rules(a: Qwen3_5Args, fused_experts: bool) -> list[TensorRule]:
    """The MTP module (mtp_depth 1): `mtp.fc`, `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding`,
    `mtp.norm` and `mtp.layers.0.*`, a full-attention block whose feed-forward is block 0's
    kind, as forja's mtp.layers.{n_layers} (Qwen3_5.build_mtp)."""
    if not a.mtp_depth:
        return []
    ours = f"mtp.layers.{a.n_layers}."
    return hf_rules.renamed(_MTP_OWN, "mtp.", ours) + block_rules(a, "mtp.layers.0.", ours + "block.", attention_rules,
                                                                  0, fused_experts)


def _rules(a: Qwen3_5Args, fused_experts: bool) -> list[TensorRule]:
    """The blocks' rules and the MTP module's when counted."""
    return model_rules(a, fused_experts) + mtp_rules(a, fused_experts)


def normalize_name(name: str) -> str:
    """The multimodal checkpoints' text model, `model.language_model.*`, as `model.*`."""
    return re.sub(r"^model\.language_model\.", "model.", name)


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    **hf_rules.expert_layouts(_rules), normalize_name=normalize_name, held_args=held_args)
