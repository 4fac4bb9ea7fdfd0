"""DeepSeek-V4's mixture of experts (forja/models/common/hash_moe.py) against transformers'
DeepseekV4SparseMoeBlock on random weights: a hash-routed layer (tid2eid lookup) and a
top-k layer with sqrt-softplus scores and the balancing bias, both with limited SwiGLUs."""

from __future__ import annotations

import pytest
import torch

from forja.errors import ForjaError
from forja.models.common.hash_moe import ScoredMoE, ScoredMoEArgs
from tests.unit.models.deepseek_v4_reference import randomize, tiny_config


def _moe_args(config, **kw) -> ScoredMoEArgs:
    fields = dict(n_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                         moe_ffn_dim=config.moe_intermediate_size, n_shared_experts=1,
                         score_func=config.scoring_func, route_scale=config.routed_scaling_factor,
                         expert_bias=True, swiglu_limit=config.swiglu_limit)
    return ScoredMoEArgs(**{**fields, **kw})


def _forja_state(ref_state: dict, inter: int) -> dict:
    out = {}
    for k, v in ref_state.items():
        if k == "experts.gate_up_proj":
            out["experts.w1"], out["experts.w3"] = v[:, :inter], v[:, inter:]
        elif k == "experts.down_proj":
            out["experts.w2"] = v
        else:
            k = k.replace("gate.e_score_correction_bias", "router.expert_bias").replace("gate.", "router.gate.", 1)
            k = k.replace("router.gate.tid2eid", "router.tid2eid")
            for old, new in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                k = k.replace(f"shared_experts.{old}", f"shared_experts.{new}")
            out[k] = v
    return out


@pytest.mark.parametrize("layer", [0, 1])  # 0: hash_moe, 1: moe
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_moe_matches_transformers(layer, scoring):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    config = tiny_config(mlp_layer_types=["hash_moe", "moe", "moe"], scoring_func=scoring)
    ref = DeepseekV4SparseMoeBlock(config, layer)
    randomize(ref, seed=6)
    with torch.no_grad():
        if layer == 0:
            ref.gate.tid2eid.copy_(torch.randint(0, config.n_routed_experts, ref.gate.tid2eid.shape,
                                                 generator=torch.Generator().manual_seed(0)))
        else:
            ref.gate.e_score_correction_bias.normal_(generator=torch.Generator().manual_seed(1))
    ours = ScoredMoE(config.hidden_size, _moe_args(config), hashed=layer == 0, vocab_size=config.vocab_size)
    ours.load_state_dict(_forja_state(ref.state_dict(), config.moe_intermediate_size))
    x = torch.randn(2, 7, config.hidden_size)
    ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        expected = ref(x, input_ids=ids)
        assert (ours(x, ids) - expected).abs().max() < 1e-5


def test_a_hash_layer_needs_token_ids_and_scores_are_checked():
    config = tiny_config()
    ours = ScoredMoE(config.hidden_size, _moe_args(config), hashed=True, vocab_size=config.vocab_size)
    with pytest.raises(ForjaError, match="token ids"):
        ours(torch.randn(1, 3, config.hidden_size))
    with pytest.raises(ForjaError, match="score_func"):
        ScoredMoE(config.hidden_size, _moe_args(config, score_func="relu"), hashed=False, vocab_size=8)
