"""Typed configs: TOML recipes, --set overrides, clear errors, a faithful dump."""

import pytest

from forja.config import CONFIG_DIR, Config, config_from_dict, dump_toml, load_config, tomllib
from forja.errors import ForjaError
from forja.optim.config import DEFAULT_LR
from forja.optim.optimizers import OPTIMIZERS


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
def test_every_recipe_loads_and_round_trips(name):
    cfg = load_config(name)
    assert config_from_dict(tomllib.loads(dump_toml(cfg))) == cfg


def test_overrides_are_typed():
    cfg = load_config("debug", ["train.steps=7", "optim.betas=[0.8, 0.9]", "model.overrides={n_layers = 2}",
                                "run.dir=/tmp/x y", "checkpoint.async_save=true", "optim.lr=1"])
    assert cfg.train.steps == 7 and cfg.optim.betas == (0.8, 0.9) and cfg.model.overrides == {"n_layers": 2}
    assert cfg.run.dir == "/tmp/x y" and cfg.checkpoint.async_save is True
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_defaults_without_a_recipe():
    assert load_config(None) == Config()


@pytest.mark.parametrize(("override", "message"), [
    ("train.stpes=1", "unknown key train.stpes from --set; did you mean train.steps?"),
    ("trian.steps=1", "unknown key trian from --set; did you mean train?"),
    ("model.overrides={n_layer = 2}", "unknown key model.overrides.n_layer (the fields of llama's model); "
                                      "did you mean model.overrides.n_layers?"),
    ("train.steps=1.5", "train.steps = 1.5 is not valid: it must be an integer"),
    ("train.steps=0", "train.steps = 0 must be at least 1"),
    ("train.precision=fp64", "train.precision = 'fp64' is not valid: it must be one of 'auto', 'fp32', 'bf16', 'fp16'"),
    ("checkpoint.async_save=yes", "checkpoint.async_save = 'yes' is not valid: it must be true or false"),
    ("metrics.sinks=3", "metrics.sinks = 3 is not valid: it must be a list of strings"),
    ('optim.betas="0.9"', "optim.betas = '0.9' is not valid: it must be a list of numbers"),
    ("steps=1", "name a key inside a section"),
    ("train.steps", "must look like section.key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ForjaError, match=message.replace("?", r"\?").replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config("debug", [override])


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ForjaError, match="config 'llama9' not found: give a .toml path or one of: debug, default"):
        load_config("llama9")


def test_a_single_string_is_a_list_of_one():
    cfg = load_config("debug", ['debug.inject="nan@15"', 'metrics.sinks="jsonl"', "eval.tasks=python_mc"])
    assert cfg.debug.inject == ["nan@15"] and cfg.metrics.sinks == ["jsonl"] and cfg.eval.tasks == ["python_mc"]
    assert load_config("debug", ['debug.inject=["nan@15", "kill@20"]']).debug.inject == ["nan@15", "kill@20"]


def test_every_optimizer_has_a_default_lr():
    assert set(DEFAULT_LR) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(DEFAULT_LR))
def test_switching_the_optimizer_takes_its_default_lr(name):
    recipe = load_config("debug")
    assert (recipe.optim.name, recipe.optim.lr) == ("adamw", DEFAULT_LR["adamw"])  # the rule's premise
    assert load_config("debug", [f"optim.name={name}"]).optim.lr == DEFAULT_LR[name]
    assert load_config("debug", [f"optim.name={name}", "optim.lr=0.05"]).optim.lr == 0.05
    assert load_config("debug", ["optim.lr=0.05", f"optim.name={name}"]).optim.lr == 0.05  # order is no matter


def test_a_recipe_lr_is_for_its_own_optimizer(tmp_path):
    # gpt2-124m tunes AdamW at 6e-4, 1/5 of AdamW's default: another optimizer gets 1/5 of its own.
    gpt2 = load_config("gpt2-124m", ["optim.name=lion"]).optim
    assert gpt2.lr == pytest.approx(6e-4 * DEFAULT_LR["lion"] / DEFAULT_LR["adamw"], rel=1e-3)
    assert load_config("gpt2-124m", ["optim.name=adamw"]).optim.lr == 6e-4  # the recipe's own optimizer
    recipe = tmp_path / "lion.toml"
    recipe.write_text('[optim]\nname = "lion"\nlr = 2e-4\n')
    assert load_config(str(recipe)).optim.lr == 2e-4  # a recipe that sets both keeps its lr
    assert load_config(str(recipe), ["train.steps=3"]).optim.lr == 2e-4
    to_adamw = load_config(str(recipe), ["optim.name=adamw"]).optim.lr
    assert to_adamw == pytest.approx(2e-4 * DEFAULT_LR["adamw"] / DEFAULT_LR["lion"], rel=1e-3)
