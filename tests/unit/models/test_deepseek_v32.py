"""DeepSeek-V3.2 against transformers' DeepseekV32ForCausalLM on random weights: the conformance
CASE (logits at 48 tokens, sparse with index_topk 8 and whole with index_topk 64; checkpoints
written back tensor for tensor, greedy decoding through the KV cache and the indexer's cached
keys, the published size, refused configs) and what is its own. The mechanism's training,
documents and FLOPs: test_sparse_attention.py. Tensor parallelism: test_tp_families.py."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_model
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8}
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, index_n_heads=4, index_head_dim=16)
SPARSE = dict(SHAPE, index_topk=8, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
              topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
              rope_parameters=YARN)
# index_topk above the 48 tokens: every query keeps all its keys (fewer than top-k exist).
WHOLE = dict(SHAPE, index_topk=64, index_n_heads=2, index_head_dim=24, n_routed_experts=6, n_shared_experts=1,
             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2, norm_topk_prob=False,
             tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50_000.0})


def make(cls: str):
    """The `make` of a FamilyCase for transformers' `cls` (DeepseekV32ForCausalLM or GLM-5's)."""
    def _make(name: str, config: checks.HFConfig, seed: int):
        torch.manual_seed(seed)
        # A wide init: peaked logits (greedy far from ties), decisive routing and index scores.
        model_cls = getattr(transformers, cls)
        model = model_cls(model_cls.config_class(initializer_range=0.1, **config.config)).eval()
        with torch.no_grad():  # a trained-looking balancing bias, so that it matters
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
        return model
    return _make


@torch.no_grad()
def balancing_bias(model) -> None:
    for _, buf in model.named_buffers():
        buf.normal_(0.0, 0.05)


def refusals(name: str) -> tuple:
    return (
        (name, {"q_lora_rank": None}, r"q_lora_rank=None is not supported; the sparse attention's indexer"),
        (name, {"mlp_layer_types": ["sparse", "dense", "sparse"]}, r"mlp_layer_types=\[.*\] is not supported"),
        (name, {"attention_bias": True}, r"attention_bias=True is not supported"),
        (name, {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        (name, {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope type='longrope' is not"),
        (name, {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config\.quant_method='fp8' is not"),
    )


CASE = checks.FamilyCase(
    family="deepseek_v32",
    configs={"sparse_yarn_groups": checks.HFConfig("DeepseekV32ForCausalLM", SPARSE),
             "whole_tied": checks.HFConfig("DeepseekV32ForCausalLM", WHOLE)},
    make=make("DeepseekV32ForCausalLM"),
    # Bound on max |logit difference| in float32 (transformers 5.25, torch 2.13, CPU): measured
    # 9.5e-7 and 0, 1.5e-6 at most over the random configs. The indexer's scores are
    # transformers' products in fp32 (the same selection); attention runs dense under the
    # selection's mask, as transformers' does. float64: 0.
    tol=1e-5,
    # float64: transformers' RMSNorm and router in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("deepseek_v32.DeepseekV32RMSNorm.forward", "deepseek_v32.DeepseekV32TopkRouter.forward"),
    same_tensors=True,
    # Not `uncached`: a full forward and a cached step compute the index scores with other shapes,
    # and top-k selection (a discrete choice) can flip on a tie: transformers' own full forward
    # differs from its generate there too (GLM-5's sparse config, token 31 of 32).
    greedy={"sparse_yarn_groups": 32, "whole_tied": 24},
    prepare_export=balancing_bias, export_tokens=80,
    published={"671b": (671_877_929_216, 38_403_807_488, 37_477_128_448)},
    fused={"sparse_yarn_groups": ("model.layers.1.mlp.experts.gate_up_proj",)},
    refusals=refusals("sparse_yarn_groups"),
    export_refusals=(({"index_rope_interleaved": True}, r"index_rope_interleaved=True has no DeepseekV32ForCausalLM"),),
)

checkpoints, loaded = checks.family_fixtures(CASE)


def test_selection_matters_and_short_rows_keep_every_key(checkpoints, loaded):
    """At 48 tokens the top 8 keys are not all keys (the logits move when k grows to 48); at 6
    tokens, fewer than top-k exist and each query attends to all it may see, as transformers does."""
    hf, model = checkpoints["sparse_yarn_groups"][1], loaded["sparse_yarn_groups"]
    tokens = checks.random_tokens(48, vocab_size=300)
    sparse = model(tokens)
    for block in model.layers.values():
        block.attention.topk = 48
    try:
        assert (model(tokens) - sparse).abs().max() > 1e-2
    finally:
        for block in model.layers.values():
            block.attention.topk = 8
    assert max_logit_diff(hf, model, checks.random_tokens(6, vocab_size=300)) < CASE.tol


def test_debug_flavor():
    model = build_model("deepseek_v32", "debug", device="meta")
    assert 1.5e6 < model.num_params() < 2.5e6
    attention = model.layers["0"].attention
    assert attention.topk == 8 and attention.indexer.wq_b.weight.shape == (4 * 32, 64)
    assert model.layers["0"].structure.indexer == (4, 32, 8, 0)  # untrained
