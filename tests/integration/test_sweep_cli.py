"""`forja sweep` end to end: a 2 x 1 grid of debug runs, resumed after a kill, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from forja.cli import main

from .conftest import base_overrides, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GRID = ["--grid", "optim.lr=1e-3,3e-2", "--grid", "train.seed=1"]


def common_sets(tmp_path, data) -> list[str]:
    """The fast debug settings, without run.dir: the sweep gives each trial its own."""
    sets = base_overrides(tmp_path / "unused", data, **{"train.steps": "4", "train.val_interval": "2",
                                                        "checkpoint.interval": "2"})
    return [a for s in sets if not s.startswith("run.dir=") for a in ("--set", s)]


def test_a_sweep_trains_every_trial_and_resumes(tmp_path, train_data, capsys):
    sweep_dir = tmp_path / "sweep"
    argv = ["sweep", "debug", *GRID, *common_sets(tmp_path, train_data), "--dir", str(sweep_dir)]
    assert main(argv) == 0
    state = json.loads((sweep_dir / "sweep.json").read_text())
    names = [t["name"] for t in state["trials"]]
    assert names == ["trial-0-lr=1e-3-seed=1", "trial-1-lr=3e-2-seed=1"]
    assert [t["status"] for t in state["trials"]] == ["done", "done"]
    assert [t["values"]["optim.lr"] for t in state["trials"]] == ["1e-3", "3e-2"]
    assert (sweep_dir / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "val loss" in out and "trial-0" in out and "trial-1" in out
    metrics = {n: read_metrics(sweep_dir / n) for n in names}
    assert all(any("val_loss" in r for r in m) for m in metrics.values())

    # Rerunning the same command trains nothing again.
    assert main(argv) == 0
    assert {n: read_metrics(sweep_dir / n) for n in names} == metrics

    # Killed during the second trial, before its first checkpoint: it is trained again, the first is not.
    state["trials"][1]["status"] = "running"
    (sweep_dir / "sweep.json").write_text(json.dumps(state))
    shutil.rmtree(sweep_dir / names[1])
    assert main(argv) == 0
    assert read_metrics(sweep_dir / names[0]) == metrics[names[0]]
    assert any("val_loss" in r for r in read_metrics(sweep_dir / names[1]))
    assert [t["status"] for t in json.loads((sweep_dir / "sweep.json").read_text())["trials"]] == ["done"] * 2

    # --summary alone reprints the table; another grid in the same directory is refused.
    capsys.readouterr()
    assert main(["sweep", "--dir", str(sweep_dir), "--summary"]) == 0
    assert "trial-1" in capsys.readouterr().out
    assert main(["sweep", "debug", "--grid", "optim.lr=1e-2", "--dir", str(sweep_dir)]) == 2
    assert "holds another sweep (its grid differs" in capsys.readouterr().err


@pytest.mark.parametrize(("grid", "message"), [
    ("optim.lr", "must look like section.key=V1,V2"),
    ("optim.lr=", "has an empty value list"),
    ("optim.lr= , ", "has an empty value list"),
    ("optim.nonsense=1,2", "nonsense"),
])
def test_bad_grids_stop_before_anything_is_launched(tmp_path, grid, message, capsys):
    sweep_dir = tmp_path / "sweep"
    assert main(["sweep", "debug", "--grid", grid, "--dir", str(sweep_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not sweep_dir.exists()


def test_random_draws_are_reproducible():
    from forja.sweep import make_trials

    grid = {"optim.lr": ["1e-3", "3e-3", "1e-2"], "model.overrides.dim": ["128", "256"]}
    assert make_trials(grid, 5, seed=3) == make_trials(grid, 5, seed=3)
    assert len(make_trials(grid, 5, seed=3)) == 5
    assert len(make_trials(grid, None, seed=0)) == 6


def test_parallel_trials_share_the_cores(monkeypatch):
    from forja.sweep import _child_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert _child_env(4)["OMP_NUM_THREADS"] == "2"
    assert _child_env(16)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in _child_env(1)  # one trial: torch's own default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _child_env(4)["OMP_NUM_THREADS"] == "3"  # the user's choice stands


def test_linked_keys_sweep_together_and_the_coordinate_check_is_plotted(tmp_path, train_data):
    sweep_dir = tmp_path / "widths"
    grid = ["--grid", "model.overrides.dim+model.overrides.ffn_dim=32+96,64+192", "--grid", "model.mup_base_dim=32"]
    assert main(["sweep", "debug", *grid, *common_sets(tmp_path, train_data), "--dir", str(sweep_dir)]) == 0
    state = json.loads((sweep_dir / "sweep.json").read_text())
    assert [t["name"] for t in state["trials"]] == ["trial-0-dim+ffn_dim=32+96-mup_base_dim=32",
                                                   "trial-1-dim+ffn_dim=64+192-mup_base_dim=32"]
    for trial in state["trials"]:
        width, ffn = (int(v) for v in trial["values"]["model.overrides.dim+model.overrides.ffn_dim"].split("+"))
        config = (sweep_dir / trial["name"] / "config.toml").read_text()
        assert f"dim = {width}" in config and f"ffn_dim = {ffn}" in config
        sizes = [r for r in read_metrics(sweep_dir / trial["name"]) if "val_act_hidden" in r]
        assert sizes and sizes[0]["val_act_hidden"] > 0 and sizes[0]["val_act_logits"] > 0
    assert (sweep_dir / "coords.png").read_bytes()[:8] == PNG_MAGIC


def test_linked_values_need_one_part_per_key(tmp_path, capsys):
    grid = "model.overrides.dim+model.overrides.ffn_dim=32+96,64"
    assert main(["sweep", "debug", "--grid", grid, "--dir", str(tmp_path / "s")]) == 2
    assert "links 2 keys" in capsys.readouterr().err

