"""Hugging Face `LlamaForCausalLM` <-> forja Llama.

Reads both config.json dialects: transformers 4.x (`rope_theta` and `rope_scaling`,
as the published Llama 3 checkpoints have) and 5.x (`rope_parameters`). Both use
RoPE's rotate-half layout, as forja does, so q/k weights load unpermuted.
"""

from __future__ import annotations

from forja.errors import ForjaError
from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.llama.model import LlamaArgs

ARCHITECTURES = ("LlamaForCausalLM",)
IGNORED: tuple[str, ...] = ()  # patterns of Hugging Face tensors forja does not need


def args_from_config(cfg: dict) -> LlamaArgs:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ForjaError(f"config.json: {key}=true is not supported by forja's Llama (it has no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ForjaError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported; Llama uses 'silu'")
    args = hf_rules.decoder_args(cfg)
    return LlamaArgs(**args, **hf_rules.rope_args(cfg, args["max_seq_len"], 10_000.0))


def config_from_args(a: LlamaArgs) -> dict:
    if blockers := a.hf_blockers():
        raise ForjaError(f"a Llama with {', '.join(blockers)} has no LlamaForCausalLM equivalent in transformers; "
                         "load its checkpoint with forja (forja generate, forja eval) or export a model trained "
                         "without them")
    return {"architectures": list(ARCHITECTURES), "model_type": "llama", **hf_rules.decoder_config(a),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **hf_rules.rope_config(a)}


def rules(a: LlamaArgs) -> list[TensorRule]:
    layer = [*hf_rules.attention_pairs(), *hf_rules.MLP_PAIRS, *hf_rules.NORM_PAIRS["pre"]]
    return hf_rules.decoder_rules(a, hf_rules.renamed(layer))


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, rules, IGNORED)
