"""Bad input to `forja train`: one clear line each, before any work, nothing corrupted."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forja.cli import main
from forja.config import load_config
from forja.errors import ForjaError
from forja.train.callbacks import Callback
from forja.train.trainer import Trainer

from .conftest import base_overrides, losses, read_metrics, train_args


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


def test_typo_in_a_key_names_it_and_suggests(tmp_path, train_data, capsys):
    assert main(train_args(tmp_path / "r", train_data) + ["--set", "train.stpes=5"]) == 2
    assert "unknown key train.stpes from --set; did you mean train.steps?" in _error(capsys)
    assert not (tmp_path / "r").exists()


def test_typo_in_a_recipe_names_the_file(tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[optim]\nlearning_rate = 1e-3\n")
    assert main(["train", str(recipe)]) == 2
    assert f"unknown key optim.learning_rate in {recipe}" in _error(capsys)


def test_wrong_type_and_bad_choice(tmp_path, train_data, capsys):
    assert main(train_args(tmp_path / "r", train_data, **{"train.steps": '"many"'})) == 2
    assert "train.steps = 'many' is not valid: it must be an integer" in _error(capsys)
    assert main(train_args(tmp_path / "r", train_data, **{"schedule.name": '"cosin"'})) == 2
    assert "schedule.name = 'cosin' is not valid: it must be one of 'cosine', 'linear', 'wsd'" in _error(capsys)


def test_missing_data_path(tmp_path, capsys):
    assert main(train_args(tmp_path / "r", tmp_path / "nowhere")) == 2
    assert "data.path: source path" in (err := _error(capsys)) and "does not exist" in err


def test_run_dir_with_another_config_is_refused_unless_starting_over(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{"train.steps": "4"})) == 0
    before = losses(run)
    assert main(train_args(run, train_data, **{"train.steps": "4", "optim.lr": "0.01"})) == 2
    assert "holds another run: optim.lr: 0.003 -> 0.01" in _error(capsys)
    assert losses(run) == before and (run / "checkpoints" / "step-00000004").is_dir()
    assert main(train_args(run, train_data, **{"train.steps": "4", "optim.lr": "0.01"}) + ["--start-over"]) == 0
    assert losses(run) != before
    assert "start_over = false" in (run / "config.toml").read_text()  # the next launch resumes


def test_checkpoint_of_another_flavor_is_refused(tmp_path, train_data, capsys):
    source = tmp_path / "debug-run"
    assert main(train_args(source, train_data, **{"train.steps": "2"})) == 0
    other = train_args(tmp_path / "r2", train_data, **{"model.flavor": '"tiny"',
                                                       "model.init_from": f'"{source}"'})
    assert main(other) == 2
    assert "the checkpoint holds a llama 'debug' model, this run builds a llama 'tiny' model (dim: 128 vs 256" \
        in _error(capsys)
    same = train_args(tmp_path / "r3", train_data, **{"model.init_from": f'"{source}"', "train.steps": "1",
                                                      "optim.lr": "1e-9", "schedule.warmup_steps": "0"})
    assert main(same) == 0  # the same model starts from those weights: its loss is the source's last
    assert abs(losses(tmp_path / "r3")[1] - losses(source)[2]) < 0.5


def test_unwritable_run_dir(tmp_path, train_data, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert main(train_args(tmp_path / "file" / "run", train_data)) == 2
    assert "cannot be written" in _error(capsys)


def test_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path, train_data):
    """A file-size limit (what a full disk looks like to a writer) hits the second checkpoint."""
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **{"train.steps": "4"})) == 0  # step-4 checkpoint, ~7 MB
    size = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file())
    limited = (f"import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({size // 2}, {size // 2})); "
               "from forja.cli import main; sys.exit(main(sys.argv[1:]))")
    args = train_args(run, train_data, **{"train.steps": "8"})
    done = subprocess.run([sys.executable, "-c", limited, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "could not write checkpoint step-00000008" in done.stderr
    assert "step-00000004 is intact" in done.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]
    assert main(train_args(run, train_data, **{"train.steps": "8"})) == 0  # and it resumes from there


class PoisonAt(Callback):
    """Sets a weight to NaN after step `step`, as a diverging run would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record) -> None:
        if record.step == self.step:
            with torch.no_grad():
                trainer.model.norm.weight.fill_(float("nan"))


def _config(run, data, **changes):
    return load_config("debug", base_overrides(run, data, **changes))


def test_nan_loss_stops_with_the_last_checkpoint_intact(tmp_path, train_data):
    run = tmp_path / "run"
    with pytest.raises(ForjaError, match=r"step 6: the loss is nan: training stopped and the last checkpoint, "
                                         r".*step-00000004, is intact"):
        Trainer(_config(run, train_data), callbacks=[PoisonAt(5)]).run()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]


def test_nan_loss_can_be_skipped_and_counted(tmp_path, train_data):
    run = tmp_path / "run"
    cfg = _config(run, train_data, **{"train.on_nonfinite": '"skip"', "train.steps": "6"})
    Trainer(cfg, callbacks=[PoisonAt(3)]).run()  # runs to the end instead of stopping
    train = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] != r["loss"] for r in train[3:])  # NaN: the poisoned weight stays NaN
    assert [r.get("skipped_steps") for r in train] == [None, None, None, 1, 2, 3]
