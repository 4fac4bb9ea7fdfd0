"""The preflight: every bad input of a launch stops with one sentence and exit code 2 before
anything is written: no run directory, no restart counted, no tokenizer trained, and with
`--nproc` before torchrun starts (so the sentence is printed once, not once per rank)."""

from __future__ import annotations

import json

import pytest

from forja.cli import main
from forja.data import prepare, train_tokenizer

from .conftest import train_args


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A tokenizer the test corpus was not prepared with."""
    out = tmp_path_factory.mktemp("other-tok") / "tokenizer.json"
    train_tokenizer("stdlib:json", vocab_size=300, out=out)
    return out


@pytest.fixture(scope="module")
def no_val_data(tmp_path_factory, train_data):
    """Prepared data without a validation split (val_fraction 0)."""
    root = tmp_path_factory.mktemp("no-val")
    prepare("stdlib:json", train_data / "tokenizer.json", root / "prepared", val_fraction=0.0, workers=1)
    return root / "prepared"


def _launch(run, data, nproc: int | None, capsys, **sets) -> str:
    """Run `forja train` (through the launcher when nproc is given); returns its stderr after
    checking the exit code, the single line and that nothing was written."""
    args = train_args(run, data, **sets) + (["--nproc", str(nproc)] if nproc else [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one sentence, no traceback
    assert err.startswith("forja train: error: ")
    assert not run.exists(), sorted(p.name for p in run.iterdir())
    return err


@pytest.mark.parametrize("nproc", [None, 2])
def test_bad_inputs_stop_before_any_write(tmp_path, train_data, other_tokenizer, no_val_data, nproc, capsys):
    run = tmp_path / "run"
    cases = [
        (train_data, dict(**{"data.path": json.dumps(str(tmp_path / "missing" / "*.py"))}), "matches no file"),
        (train_data, {"data.tokenizer": json.dumps(str(other_tokenizer))}, "use the tokenizer it was prepared with"),
        (train_data, {"data.tokenizer": json.dumps(str(tmp_path / "nope.json"))}, "data.tokenizer"),
        (no_val_data, {}, "the validation split"),
        (train_data, {"train.global_batch_size": "6"}, "is not divisible by train.micro_batch_size = 4"),
        (train_data, {"model.flavor": '"3.1-8b"'}, "is predicted to need"),
        (train_data, {"train.float8": '"tensorwise"', "train.float8_min_features": "1024"},
         "converts no Linear layer"),
    ]
    if nproc:
        cases.append((train_data, {"train.global_batch_size": "5", "train.micro_batch_size": "1"},
                      "train.global_batch_size = 5 is not divisible by the data-parallel degree 2"))
        cases.append((train_data, {"parallel.tp": "2", "model.overrides.n_kv_heads": "1"},
                      "model n_kv_heads = 1 (parallel.tp = 2) is not divisible by 2"))
        cases.append((train_data, {"parallel.cp": "2", "optim.qk_clip_tau": "100.0"},
                      "optim.qk_clip_tau / optim.max_logit_metric cannot be used with parallel.cp > 1"))
    for data, sets, words in cases:
        err = _launch(run, data, nproc, capsys, **sets)
        assert words in err, (sets, err)


def test_a_corrected_rerun_is_not_refused(tmp_path, train_data, capsys):
    """The failed launch left no config.toml behind, so the fixed command just runs."""
    run = tmp_path / "run"
    _launch(run, train_data, None, capsys, **{"train.global_batch_size": "6"})
    assert main(train_args(run, train_data, **{"train.steps": "2"})) == 0
    launches = json.loads((run / "run.json").read_text())["launches"]
    goodput = json.loads((run / "goodput.json").read_text())
    assert len(launches) == 1 and len(goodput["segments"]) == 1


def test_the_default_recipe_runs_on_two_ranks_as_written():
    """configs/default.toml's batch divides over --nproc 2 (global 8, micro 4): the validator
    accepts its layout on 2 ranks."""
    from forja.config import load_config
    from forja.models.config import run_model_args
    from forja.parallel.checks import layout_errors
    from forja.train.launch.preflight import Preflight

    cfg = load_config("default", [])
    args = run_model_args(cfg.model, cfg.data.vocab_size)
    assert layout_errors(Preflight(cfg, world_size=2, device_type="cpu", args=args).request()) == []
    # 8 / 4 ranks < micro 4: refused, with its reason
    assert layout_errors(Preflight(cfg, world_size=4, device_type="cpu", args=args).request())
