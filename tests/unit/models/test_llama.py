"""Llama against transformers: the conformance CASE (grouped-query attention, Llama 3.1's
rope scaling past its original context, tied and untied embeddings, a head width that is not
dim / heads), and what is Llama's own: the transformers 4.x config.json dialect."""

from __future__ import annotations

import json
import shutil

import pytest

from forja.models import load_hf_checkpoint
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

CASE = checks.FamilyCase(
    family="llama",
    configs={
        # GQA 4:1, llama3 rope scaling (original context 32 < the test's 48 tokens), tied embeddings.
        "gqa_scaled_tied": checks.HFConfig("LlamaForCausalLM", dict(
            hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=True, rope_theta=500_000.0, rope_scaling=LLAMA3_SCALING)),
        # Untied, plain RoPE with another theta, multi-head (no grouping), another eps.
        "untied_theta": checks.HFConfig("LlamaForCausalLM", dict(
            hidden_size=48, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False, rope_theta=10_000.0)),
        # A head_dim that is not hidden_size / heads, and GQA 2:1.
        "head_dim": checks.HFConfig("LlamaForCausalLM", dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
            tie_word_embeddings=False, rope_theta=250_000.0)),
    },
    # A few times what is measured (transformers 5.24, torch 2.13, CPU): 0.0, the same ops in
    # the same order as transformers.
    tol=1e-6,
    # float64: transformers' RMSNorm in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("llama.LlamaRMSNorm.forward",),
    layout=checks.stored_names,
    greedy={"gqa_scaled_tied": 32, "untied_theta": 32, "head_dim": 32}, uncached=True,
    # Counts of the released checkpoints (tied weights once).
    published={"3.2-1b": (1_235_814_400,), "3.2-3b": (3_212_749_824,), "3.1-8b": (8_030_261_248,),
               "3.1-70b": (70_553_706_496,), "3.1-405b": (405_853_388_800,)},
    export_refusals=((dict(qk_norm=True), "qk_norm"),),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def _to_4x_dialect(cfg: dict) -> dict:
    """Rewrite a transformers 5.x config (rope_parameters) the way 4.x wrote it."""
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params if params.get("rope_type") != "default" else None
    return cfg


@pytest.mark.parametrize("name", ["gqa_scaled_tied", "untied_theta"])
def test_reads_transformers_4x_config_dialect(checkpoints, tmp_path, name):
    path, hf = checkpoints[name]
    old = tmp_path / "old"
    shutil.copytree(path, old)
    cfg = json.loads((old / "config.json").read_text())
    assert "rope_parameters" in cfg  # what transformers 5 writes
    (old / "config.json").write_text(json.dumps(_to_4x_dialect(cfg)))
    tokens = checks.random_tokens(40, 2, vocab_size=hf.config.vocab_size)[:1]
    assert max_logit_diff(hf, load_hf_checkpoint(old), tokens) < CASE.tol
