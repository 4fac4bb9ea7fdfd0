"""model.rope_scaling: one key for every rotary family, Llama 3's rule or YaRN, checked at load,
kept through Hugging Face export (transformers computes the same logits) and import."""

from __future__ import annotations

import pytest
import torch

from forja.config import load_config
from forja.errors import ForjaError
from forja.models import build_from_args, load_hf_checkpoint, save_hf_checkpoint
from forja.models.common.rope import RopeScaling, YarnScaling, rope_scaling_from
from forja.models.config import ModelConfig, run_model_args
from tests.helpers import max_logit_diff

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_seq_len": 16}
ROTARY = ["llama", "qwen3", "mixtral", "olmo3", "deepseek_v3", "gpt_oss", "gemma3", "qwen3_5", "qwen3_next"]


@pytest.mark.parametrize("family", ROTARY)
@pytest.mark.parametrize("table, kind", [(YARN, YarnScaling), (LLAMA3, RopeScaling)])
def test_every_rotary_family_takes_both_rules(family, table, kind):
    args = run_model_args(ModelConfig(family=family, flavor="debug", rope_scaling=table), 256)
    assert isinstance(args.rope_scaling, kind) and args.rope_scaling.factor == 4.0
    model = build_from_args(args, device="meta")
    plain = build_from_args(run_model_args(ModelConfig(family=family, flavor="debug",
                                                       rope_scaling={"rope_type": "default"}), 256), device="meta")
    assert plain.args.rope_scaling is None
    assert not torch.equal(model.rope_frequencies(), plain.rope_frequencies())  # the low frequencies moved
    expected = 0.1 * torch.log(torch.tensor(4.0)).item() + 1 if kind is YarnScaling else 1.0
    assert model.rope_scale() == pytest.approx(expected)  # YaRN's temperature on cos and sin


def test_set_from_the_command_line():
    cfg = load_config("debug", ['model.rope_scaling={rope_type = "yarn", factor = 2.0, original_max_seq_len = 64}'])
    assert cfg.model.scaling() == YarnScaling(factor=2.0, original_max_seq_len=64)


@pytest.mark.parametrize("table, match", [
    ({"factor": 2.0}, "needs a rope_type"),
    ({"rope_type": "longrope", "factor": 2.0}, r"model\.rope_scaling\.rope_type = 'longrope'.*\"yarn\""),
    ({"rope_type": "yarn", "factr": 2.0}, r"model\.rope_scaling\.factr is not a field of rope_type 'yarn'"),
    ({"rope_type": "yarn", "factor": 0.5}, r"model\.rope_scaling: factor = 0\.5 must be >= 1"),
    ({"rope_type": "yarn", "factor": "big"}, r"model\.rope_scaling\.factor = 'big' must be a number"),
    ({"rope_type": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "low_freq_factor < high_freq_factor"),
    ({"rope_type": "yarn", "beta_fast": 1.0, "beta_slow": 32.0}, "beta_slow < beta_fast"),
])
def test_bad_tables_stop_at_load_naming_the_key(table, match):
    with pytest.raises(ForjaError, match=match):
        ModelConfig(family="llama", rope_scaling=table)


def test_a_family_without_rotary_scaling_is_told_which_have_it():
    with pytest.raises(ForjaError, match=r"the gpt2 family has no rotary scaling.*llama"):
        ModelConfig(family="gpt2", flavor="debug", rope_scaling=YARN)
    with pytest.raises(ForjaError, match="both set"):
        ModelConfig(family="llama", rope_scaling=YARN, overrides={"rope_scaling": LLAMA3})


def test_recorded_args_read_back_as_the_same_rule():
    """A checkpoint records the dataclass's fields without rope_type: the fields tell the kind."""
    import dataclasses

    for s in (YarnScaling(factor=2.0), RopeScaling(factor=2.0)):
        assert rope_scaling_from(dataclasses.asdict(s), default="llama3") == s
        assert rope_scaling_from(dataclasses.asdict(s), default="yarn") == s


@pytest.mark.parametrize("family, hf_class", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                              ("mixtral", "MixtralForCausalLM"), ("olmo3", "Olmo3ForCausalLM"),
                                              ("gemma3", "Gemma3ForCausalLM"), ("qwen3_5", "Qwen3_5ForCausalLM")])
@pytest.mark.parametrize("table", [YARN, LLAMA3])
def test_hugging_face_export_keeps_the_scaling(tmp_path, family, hf_class, table):
    transformers = pytest.importorskip("transformers")
    args = run_model_args(ModelConfig(family=family, flavor="debug", rope_scaling=table), 256)
    model = build_from_args(args, seed=1).eval()
    out = save_hf_checkpoint(model, tmp_path / "hf")
    back = load_hf_checkpoint(out)
    assert back.args.rope_scaling == model.args.rope_scaling
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, 256, (2, 48))  # past the original 16 positions: the scaling matters
    assert max_logit_diff(hf, model, tokens) < 1e-4
