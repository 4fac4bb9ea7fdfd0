"""GLM-5 against transformers' GlmMoeDsaForCausalLM on random weights: the conformance CASE
(DeepSeek-V3.2's configs under GLM-5's class: its indexer rotates interleaved pairs), its
published size, and its refusal of blocks sharing a previous block's top-k."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models import family_checks as checks
from tests.unit.models.test_deepseek_v32 import SPARSE, WHOLE, balancing_bias, make, refusals

transformers = pytest.importorskip("transformers")

CASE = checks.FamilyCase(
    family="glm5",
    configs={"sparse_yarn_groups": checks.HFConfig("GlmMoeDsaForCausalLM", SPARSE),
             "whole_tied": checks.HFConfig("GlmMoeDsaForCausalLM", WHOLE)},
    make=make("GlmMoeDsaForCausalLM"),
    tol=1e-5,  # measured 1.1e-6, 0; 2.2e-6 over the random configs
    # float64: transformers' RMSNorm and router in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("glm_moe_dsa.GlmMoeDsaRMSNorm.forward", "glm_moe_dsa.GlmMoeDsaTopkRouter.forward"),
    same_tensors=True,
    # Not `uncached`: a full forward and a cached step compute the index scores with other shapes,
    # and top-k selection (a discrete choice) can flip on a tie: transformers' own full forward
    # differs from its generate there too (GLM-5's sparse config, token 31 of 32).
    greedy={"sparse_yarn_groups": 32, "whole_tied": 24},
    prepare_export=balancing_bias, export_tokens=80,
    published={"744b": (743_911_199_232, 41_784_709_632, 40_833_126_912)},
    fused={"sparse_yarn_groups": ("model.layers.1.mlp.experts.gate_up_proj",)},
    refusals=(*refusals("sparse_yarn_groups"),
              ("sparse_yarn_groups", {"indexer_types": ["full", "shared", "full"]},
               r"indexer_types=\['full', 'shared', 'full'\] is not supported; forja runs an indexer in every block")),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def test_the_interleaved_indexer_is_what_matches(checkpoints, loaded):
    """With DeepSeek-V3.2's half-split indexer rotation GLM-5's weights give other logits."""
    hf, model = checkpoints["sparse_yarn_groups"][1], loaded["sparse_yarn_groups"]
    tokens = checks.random_tokens(48, vocab_size=300)
    with torch.no_grad():
        expected = hf(tokens).logits
        for block in model.layers.values():
            block.attention.indexer.interleaved = False
        try:
            assert (model(tokens) - expected).abs().max() > 1e-3
        finally:
            for block in model.layers.values():
                block.attention.indexer.interleaved = True
