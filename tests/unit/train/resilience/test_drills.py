"""debug.inject: the drill grammar and firing once (forja/train/resilience/drills.py)."""

from __future__ import annotations

import pytest

from forja.config import load_config
from forja.errors import ForjaError
from forja.train.resilience.drills import Drill, Drills, parse_drill


def test_the_grammar():
    assert parse_drill("nan@12") == Drill(spec="nan@12", kind="nan", step=12, rank=None)
    assert parse_drill("kill@3").rank == 0  # a process-level drill needs one rank
    d = parse_drill("spike@5:rank=1:repeat")
    assert (d.kind, d.step, d.rank, d.repeat) == ("spike", 5, 1, True)
    assert parse_drill("slow@2:seconds=0.5").seconds == 0.5
    for bad in ("nan", "boom@3", "nan@0", "nan@3:when=now", "kill@x"):
        with pytest.raises(ForjaError, match="debug.inject entry"):
            parse_drill(bad)


def test_a_drill_fires_once_per_run_unless_it_repeats(tmp_path):
    drills = Drills(["nan@2", "spike@3:repeat", "nan@4:rank=1"], rank=0, run_dir=tmp_path)
    assert [drills.before_step(s) for s in (1, 2, 3, 4)] == [None, "nan", "spike", None]
    again = Drills(["nan@2", "spike@3:repeat"], rank=0, run_dir=tmp_path)  # a restarted process
    assert again.before_step(2) is None and again.before_step(3) == "spike"
    assert (tmp_path / "drills" / "rank0.json").is_file()


def test_drills_are_checked_when_the_config_loads():
    assert load_config("debug", ['debug.inject=["hang@4:rank=1"]']).debug.inject == ["hang@4:rank=1"]
    with pytest.raises(ForjaError, match="is not a drill"):
        load_config("debug", ['debug.inject=["hang-4"]'])
