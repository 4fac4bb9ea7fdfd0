"""Hugging Face `GlmMoeDsaForCausalLM` (model_type glm_moe_dsa) <-> forja GLM-5.

DeepSeek-V3.2's adapter (forja/models/deepseek_v32/hf.py) under GLM-5's architecture name,
with transformers' GLM-5 defaults (index_n_heads 32, rms_norm_eps 1e-5, one expert group) and
its indexer's interleaved rotary pairs. Refused besides DeepSeek-V3.2's refusals: blocks that
reuse the previous block's top-k (`indexer_types` with "shared", or the `index_topk_pattern` /
`index_topk_freq` / `index_skip_topk_offset` schedule making some), which forja does not build.
"""

from __future__ import annotations

import dataclasses

from forja.errors import ForjaError
from forja.models.common import hf_rules
from forja.models.common.hf_rules import HFAdapter
from forja.models.deepseek_v32 import hf as v32
from forja.models.glm5.model import GLM5Args

ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
# GLM-5's multi-token prediction layer (78 main layers), as transformers skips it.
IGNORED = (r"model\.layers\.78\..*", *v32.v3.IGNORED[1:])
_DEFAULTS = dict(rms_norm_eps=1e-5, n_group=1, topk_group=1)


def indexer_types(cfg: dict) -> list[str]:
    """Each layer's indexer kind as transformers derives it: `indexer_types`, else a pattern
    ("F"/"S" per layer), else every `index_topk_freq`-th layer after an offset runs its own."""
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(cfg["num_hidden_layers"])]


def args_from_config(cfg: dict) -> GLM5Args:
    kinds = indexer_types(cfg)
    if "shared" in kinds:
        raise ForjaError(f"config.json: indexer_types={kinds!r} is not supported; forja runs an indexer in every "
                         "block and has no cross-layer top-k reuse: give every layer 'full'")
    base = v32.dsa_args({**_DEFAULTS, **cfg}, index_n_heads=32)
    own = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return GLM5Args(**{**own, "index_rope_interleaved": True})


def config_from_args(a: GLM5Args) -> dict:
    cfg = v32.dsa_config(a, ARCHITECTURES[0], "glm_moe_dsa")
    cfg["indexer_types"] = ["full"] * a.n_layers
    return cfg


ADAPTER = HFAdapter(ARCHITECTURES, args_from_config, config_from_args, ignored=IGNORED,
                    **hf_rules.expert_layouts(v32._rules), held_args=v32.v3.held_args)
