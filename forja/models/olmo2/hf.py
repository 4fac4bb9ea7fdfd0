"""Hugging Face `Olmo2ForCausalLM` <-> forja OLMo 2.

Reads both config.json dialects, 4.x `rope_theta` + `rope_scaling` (the released checkpoints)
and 5.x `rope_parameters` (one dict: every block shares it); where absent, Olmo2Config's
defaults (base 10,000, RMSNorm eps 1e-5, head_dim = dim / n_heads). The tensors are named as
OLMo 3's (q_norm and k_norm over the whole projections, post-attention and post-feed-forward
norms: olmo3/hf.py's `rules`); forja writes the 5.x dialect.
"""

from __future__ import annotations

from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter
from forja.models.common.rope import rope_scaling_to_hf
from forja.models.olmo2.model import Olmo2Args
from forja.models.olmo3.hf import check_exportable, rules

ARCHITECTURES = ("Olmo2ForCausalLM",)
IGNORED: tuple[str, ...] = ()

_DEFAULT_THETA = 10_000.0  # Olmo2Config's default base (the released models set 500,000)
_refuse = hf_rules.refusal("OLMo 2")
_SUPPORTED = [hf_rules.no_attention_bias("OLMo 2's projections have no biases"),
              hf_rules.activation("silu", "its MLPs are SwiGLU, 'silu'"), hf_rules.NO_ATTENTION_DROPOUT]


def args_from_config(cfg: dict) -> Olmo2Args:
    hf_rules.check_config(cfg, _SUPPORTED, _refuse)
    args = hf_rules.decoder_args(cfg, rms_norm_eps=1e-5)
    rope = hf_rules.rope_args(cfg, args["max_seq_len"], _DEFAULT_THETA)
    return Olmo2Args(**args, **rope)


def config_from_args(a: Olmo2Args) -> dict:
    check_exportable(a, 2)
    rope = {"rope_type": "default"} if a.rope_scaling is None else rope_scaling_to_hf(a.rope_scaling)
    cfg = {"architectures": list(ARCHITECTURES), "model_type": "olmo2", **hf_rules.decoder_config(a),
           "hidden_act": "silu", "attention_bias": False, "rope_parameters": {**rope, "rope_theta": a.rope_theta}}
    del cfg["head_dim"]  # transformers' Olmo2Config has none: dim / n_heads
    return cfg


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
