"""OLMo 2 against transformers: the conformance CASE (post-norm blocks, QK-norm over all heads,
one rotary table; published sizes; refusals) and what is OLMo 2's own: no local attention,
the released config dialect, FLOPs. Tensor parallelism (QK-norm over all heads):
test_tp_families.py."""

from __future__ import annotations

import functools
import json

import pytest

from forja.errors import ForjaError
from forja.models import build_model, load_hf_checkpoint, model_args
from tests.helpers import max_logit_diff
from tests.unit.models import family_checks as checks

transformers = pytest.importorskip("transformers")

_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-6,
              pad_token_id=1, eos_token_id=2)

CASE = checks.FamilyCase(
    family="olmo2",
    configs={
        # The `debug` flavor: GQA 2:1, base 500,000 in the 5.x dialect.
        "debug": checks.HFConfig("Olmo2ForCausalLM", dict(
            _SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}), "debug"),
        # Llama 3's frequency scaling, multi-head, tied embeddings, Olmo2Config's default eps.
        "llama3-rope": checks.HFConfig("Olmo2ForCausalLM", dict(
            _SHAPE, num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-5,
            max_position_embeddings=64, rope_parameters={
                "rope_type": "llama3", "rope_theta": 10_000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    },
    # transformers starts every norm at 1; make each one tell
    pick=lambda key, p: "norm" in key, draw=lambda p: p.normal_(1.0, 0.3),
    # Bound on max |logit difference| in float32, against transformers 5.24, torch 2.13, CPU.
    tol=1e-5,
    # float64: transformers' RMSNorm in float64, as forja's (tests/unit/models/float64_casts.py).
    float64_kept=("olmo2.Olmo2RMSNorm.forward",),
    tokens=40,
    layout=checks.stored_names,
    greedy={"debug": 12, "llama3-rope": 12},
    # Equal to transformers' count for the same config.json (built on the meta device).
    published={"1b": (1_484_916_736,), "7b": (7_298_617_344,), "13b": (13_716_198_400,),
               "32b": (32_234_279_936,)},
    refusals=(
        ("debug", dict(attention_bias=True), r"attention_bias=True is not supported"),
        ("debug", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ),
    export_refusals=tuple((overrides, f"an OLMo 2 with {field}=") for overrides, field in [
        (dict(qk_norm=False), "qk_norm"), (dict(attention_sinks=True), "attention_sinks"),
        (dict(head_dim=16), "head_dim")]),
)

checkpoints, loaded = checks.family_fixtures(CASE)
_tokens = functools.partial(checks.random_tokens, vocab_size=_SHAPE["vocab_size"])


def test_blocks_are_post_norm_with_the_norm_over_all_heads(loaded):
    block = loaded["debug"].layers["0"]
    assert block.attention.q_norm.weight.shape == (4 * 32,) and block.attention.k_norm.weight.shape == (2 * 32,)
    assert not hasattr(block, "attention_norm") and hasattr(block, "post_ffn_norm")
    a = loaded["debug"].args
    assert [a.layer_type(i) for i in range(a.n_layers)] == ["full_attention"] * 4


def test_the_released_config_dialect_reads_the_same(checkpoints, loaded, tmp_path):
    """allenai's config.json holds rope_theta (and rope_scaling) at the top level."""
    src = checkpoints["llama3-rope"][0]
    rope = json.loads((src / "config.json").read_text())["rope_parameters"]
    dst = checks.edited_checkpoint(src, tmp_path / "ckpt", drop=("rope_parameters",),
                                   rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert load_hf_checkpoint(dst).args == loaded["llama3-rope"].args
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert max_logit_diff(hf, loaded["llama3-rope"], _tokens(30)) < CASE.tol


def test_local_attention_is_olmo3s():
    with pytest.raises(ForjaError, match=r"OLMo 2 attends to the whole context.*olmo3"):
        model_args("olmo2", "debug", sliding_window=8)


def test_debug_flavor_is_the_advertised_size():
    assert 1.2e6 < build_model("olmo2", "debug", device="meta").num_params() < 1.4e6
