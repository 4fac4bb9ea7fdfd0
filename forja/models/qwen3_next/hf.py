"""Hugging Face `Qwen3NextForCausalLM` <-> forja Qwen3-Next.

The config and most tensors read as Qwen3.5-MoE's (forja/models/qwen3_5/hf.py, whose
helpers this uses): q_proj's per-head [query | gate] rows, the conv1d over q | k | v
concatenated, per-expert or fused experts. What differs is how the Gated DeltaNet's input
projections are fused: per key-head group g (n_k of them, each serving r = n_v / n_k value
heads), in that order,

    in_proj_qkvz rows: [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)]  for g = 0 .. n_k - 1
    in_proj_ba rows:   [b_g (r) | a_g (r)]

where forja keeps wq, wk, wv, wz, wb, wa apart (each in head order, as the conv1d's
channels already are): `grouped_rows` moves rows between the two, exactly both ways.

Multi-token prediction: the published checkpoints hold one module (config.json
`mtp_num_hidden_layers: 1`): `mtp.fc`, `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding`,
`mtp.layers.0.*` (a gated-attention block with its mixture of experts) and `mtp.norm`,
computing norm(block(fc([pre_fc_norm_embedding(emb); pre_fc_norm_hidden(h)]))) with the
main model's embedding and head. That is one depth of forja/models/common/mtp.py's
MTPModule (its enorm, hnorm, proj, block, norm, the embedding first as there), loaded into
`mtp.layers.{n_layers}` and saved back under the published names. transformers builds no
MTP module (it skips `mtp.*`), so such a checkpoint still loads there as the main model;
one whose config.json counts a module it does not hold loads without it (`held_args`).
More than one MTP layer is refused: their layers share one fc and its norms, where each
of forja's depths has its own.
"""

from __future__ import annotations

import torch

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule, renamed, split_rows
from forja.models.qwen3_5.hf import (
    check_exportable_as,
    check_supported,
    common_args,
    common_config,
    held_args,
    model_rules,
    moe_args,
    mtp_depth,
    mtp_rules,
)
from forja.models.qwen3_next.model import Qwen3NextArgs

ARCHITECTURES = ("Qwen3NextForCausalLM",)
IGNORED = (r"mtp\..*",)  # the MTP module of a config.json that counts none (mtp_depth 0)
FAMILY = "Qwen3-Next"

# Qwen3NextConfig's defaults where they differ from the Qwen3.5 readers' (a config.json
# written by hand may leave them out).
_DEFAULTS = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, intermediate_size=5632, norm_topk_prob=True)


def args_from_config(cfg: dict) -> Qwen3NextArgs:
    cfg = {**_DEFAULTS, **cfg}
    check_supported(cfg, FAMILY)
    moe = moe_args(cfg) if cfg["num_experts"] else dict(n_experts=0)
    return Qwen3NextArgs(**common_args(cfg), **moe, decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                         mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()), mtp_depth=mtp_depth(cfg, FAMILY))


def config_from_args(a: Qwen3NextArgs) -> dict:
    check_exportable_as(a, FAMILY)
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **common_config(a),
           "decoder_sparse_step": a.decoder_sparse_step, "mlp_only_layers": list(a.mlp_only_layers)}
    if not a.n_experts:
        cfg["num_experts"] = 0  # transformers' default is 512: say dense outright
    return cfg


# -- tensors ---------------------------------------------------------------------------------
def grouped_rows(n_groups: int, widths: list[int]):
    """HF rows interleaved by group, (n_groups, [w_0 | w_1 | ...], D) -> forja's pieces, each
    (n_groups w_j, D) with its groups in order, and back."""
    def to_forja(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        groups = t.view(n_groups, sum(widths), t.shape[-1])  # (G, sum w, D)
        return tuple(p.reshape(-1, t.shape[-1]).contiguous() for p in groups.split(widths, dim=1))

    def to_hf(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        parts = [x.view(n_groups, -1, x.shape[-1]) for x in ts]  # (G, w_j, D) each
        return torch.cat(parts, dim=1).reshape(-1, parts[0].shape[-1])

    return to_forja, to_hf


_LINEAR_SINGLE = (("dt_bias", "dt_bias"), ("A_log", "A_log"), ("norm.weight", "norm.weight"),
                  ("out_proj.weight", "wo.weight"))


def linear_attention_rules(a: Qwen3NextArgs, hf: str, ours: str) -> list[TensorRule]:
    n_k, dk, dv = a.linear_n_k_heads, a.linear_k_head_dim, a.linear_v_head_dim
    r = a.linear_n_v_heads // n_k  # value heads per key head
    qkvz_to_forja, qkvz_to_hf = grouped_rows(n_k, [dk, dk, r * dv, r * dv])
    ba_to_forja, ba_to_hf = grouped_rows(n_k, [r, r])
    key, value = n_k * dk, a.linear_n_v_heads * dv
    conv_to_forja, conv_to_hf = split_rows([key, key, value])  # the conv's channels: q | k | v, not grouped
    mixer, lin = ours + "attention.", hf + "linear_attn."
    return [
        TensorRule(lin + "in_proj_qkvz.weight", tuple(mixer + f"{n}.weight" for n in ("wq", "wk", "wv", "wz")),
                   to_forja=qkvz_to_forja, to_hf=qkvz_to_hf),
        TensorRule(lin + "in_proj_ba.weight", (mixer + "wb.weight", mixer + "wa.weight"),
                   to_forja=ba_to_forja, to_hf=ba_to_hf),
        TensorRule(lin + "conv1d.weight", tuple(mixer + f"{n}.weight" for n in ("conv_q", "conv_k", "conv_v")),
                   to_forja=conv_to_forja, to_hf=conv_to_hf),
    ] + renamed(_LINEAR_SINGLE, lin, mixer)


def _rules(a: Qwen3NextArgs, fused_experts: bool) -> list[TensorRule]:
    return model_rules(a, fused_experts, linear=linear_attention_rules) + mtp_rules(a, fused_experts)


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    **hf_rules.expert_layouts(_rules), held_args=held_args)
