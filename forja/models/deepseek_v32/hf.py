"""Hugging Face `DeepseekV32ForCausalLM` <-> forja DeepSeek-V3.2, and the pieces GLM-5's adapter
(forja/models/glm5/hf.py) shares.

Everything but the indexer is DeepSeek-V3's (forja/models/deepseek_v3/hf.py: its config keys,
its refusals, its interleaved-to-halves permutation of MLA's rotary rows, its expert layouts).
The indexer's tensors keep transformers' names under `self_attn.indexer.` and load unchanged:
its rotary part is half-split in DeepSeek-V3.2 as forja rotates; GLM-5's interleaved pairs are
rotated as such by the indexer itself (`index_rope_interleaved`), so no row is permuted.
Refused besides DeepSeek-V3's refusals: `q_lora_rank` unset (the indexer reads the query
latent), and an `mlp_layer_types` other than `first_k_dense_replace` dense blocks then experts.
"""

from __future__ import annotations

import dataclasses

from forja.errors import ForjaError
from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter, TensorRule
from forja.models.deepseek_v3 import hf as v3
from forja.models.deepseek_v32.model import DeepSeekV32Args

ARCHITECTURES = ("DeepseekV32ForCausalLM",)
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def _refuse(key: str, value, why: str) -> ForjaError:
    return ForjaError(f"config.json: {key}={value!r} is not supported; {why}")


def dsa_args(cfg: dict, index_n_heads: int = 64, **fields) -> DeepSeekV32Args:
    """config.json -> args: DeepSeek-V3's reading plus the indexer's keys (defaults: transformers',
    `index_n_heads` the architecture's own); `fields` set the rest."""
    if not cfg.get("q_lora_rank"):
        raise _refuse("q_lora_rank", cfg.get("q_lora_rank"), "the sparse attention's indexer reads the query "
                      "latent; give q_lora_rank >= 1")
    # The main rotation is always interleaved here: transformers reads no rope_interleave key.
    base = v3.args_from_config({k: v for k, v in cfg.items() if k != "rope_interleave"})
    n_dense = base.n_dense_layers
    wanted = ["dense"] * min(n_dense, base.n_layers) + ["sparse"] * max(base.n_layers - n_dense, 0)
    if cfg.get("mlp_layer_types") not in (None, wanted):
        raise _refuse("mlp_layer_types", cfg["mlp_layer_types"], "forja's blocks are first_k_dense_replace dense "
                      "ones then mixtures of experts; drop the key or set first_k_dense_replace")
    own = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return DeepSeekV32Args(**own, index_n_heads=cfg.get("index_n_heads", index_n_heads),
                    index_head_dim=cfg.get("index_head_dim", 128), index_topk=cfg.get("index_topk", 2048), **fields)


def args_from_config(cfg: dict) -> DeepSeekV32Args:
    return dsa_args(cfg)


def dsa_config(a: DeepSeekV32Args, architecture: str, model_type: str) -> dict:
    """args -> config.json: DeepSeek-V3's keys under another architecture, and the indexer's."""
    cfg = v3.config_from_args(a)
    cfg.update(architectures=[architecture], model_type=model_type, index_n_heads=a.index_n_heads,
               index_head_dim=a.index_head_dim, index_topk=a.index_topk)
    return cfg


def config_from_args(a: DeepSeekV32Args) -> dict:
    if a.index_rope_interleaved:
        raise ForjaError("a DeepSeek-V3.2 with index_rope_interleaved=True has no DeepseekV32ForCausalLM "
                         "equivalent (its indexer rotates halves); export it as glm5")
    return dsa_config(a, ARCHITECTURES[0], "deepseek_v32")


def _rules(a: DeepSeekV32Args, fused_experts: bool) -> list[TensorRule]:
    """DeepSeek-V3's tensors, then each block's indexer (MTP blocks' too)."""
    out = v3._rules(a, fused_experts)
    for i in range(a.n_layers + a.mtp_depth):
        ours = f"layers.{i}." if i < a.n_layers else f"mtp.layers.{i}.block."
        out += hf_rules.renamed(((n, n) for n in INDEXER), f"model.layers.{i}.self_attn.indexer.",
                                ours + "attention.indexer.")
    return out


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=v3.IGNORED,
                    **hf_rules.expert_layouts(_rules), held_args=v3.held_args)
