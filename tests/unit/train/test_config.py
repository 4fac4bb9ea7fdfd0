"""Typed configs: TOML recipes, --set overrides, clear errors, a faithful dump."""

import pytest

from forja.config import CONFIG_DIR, Config, config_from_dict, dump_toml, load_config, tomllib
from forja.errors import ForjaError


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
    ("train.steps=1.5", "train.steps = 1.5 is not valid: it must be an integer"),
    ("train.steps=0", "train.steps = 0 must be at least 1"),
    ("train.precision=fp64", "train.precision = 'fp64' is not valid: it must be one of 'auto', 'fp32', 'bf16', 'fp16'"),
    ("checkpoint.async_save=yes", "checkpoint.async_save = 'yes' is not valid: it must be true or false"),
    ('metrics.sinks="console"', "metrics.sinks = 'console' is not valid: it must be a list of strings"),
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
