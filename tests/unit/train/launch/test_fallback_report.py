"""The trainer's report of forja's fallback record: one line per fallback, once, on rank 0,
and the whole list in the launch's entry of run.json (forja/train/launch/run_dir.py)."""

from __future__ import annotations

import json

import pytest

from forja import fallbacks
from forja.train.launch.run_dir import report_fallbacks


@pytest.fixture
def run_dir(tmp_path):
    fallbacks.clear()
    launches = [{"time": "earlier"}, {"time": "now"}]
    (tmp_path / "run.json").write_text(json.dumps({"launches": launches}))
    yield tmp_path
    fallbacks.clear()


def _launches(run_dir):
    return json.loads((run_dir / "run.json").read_text())["launches"]


def test_each_fallback_is_printed_once_and_all_are_kept_in_this_launch(run_dir, capsys):
    report_fallbacks(run_dir, rank=0)
    assert _launches(run_dir)[-1]["fallbacks"] == [] and capsys.readouterr().err == ""
    fallbacks.record("ops.rms_norm", asked="model.fused_ops (rms_norm)", instead="the reference",
                     why="triton does not import", fix="install triton")
    report_fallbacks(run_dir, rank=0)
    assert capsys.readouterr().err.splitlines() == [
        "forja: fallback: model.fused_ops (rms_norm) -> the reference (triton does not import); install triton"]
    fallbacks.record("attention.flex", asked='model.attention = "flex"', instead="SDPA", why="on cpu")
    fallbacks.record("ops.rms_norm", asked="again", instead="x", why="y")  # the first entry is kept
    report_fallbacks(run_dir, rank=0)
    assert capsys.readouterr().err.splitlines() == ['forja: fallback: model.attention = "flex" -> SDPA (on cpu)']
    launches = _launches(run_dir)
    assert "fallbacks" not in launches[0]  # an earlier launch keeps what it had
    assert [f["key"] for f in launches[-1]["fallbacks"]] == ["ops.rms_norm", "attention.flex"]
    assert launches[-1]["fallbacks"][0] == {"key": "ops.rms_norm", "asked": "model.fused_ops (rms_norm)",
                                            "instead": "the reference", "why": "triton does not import",
                                            "fix": "install triton"}


def test_other_ranks_print_and_write_nothing(run_dir, capsys):
    fallbacks.record("ops.swiglu", asked="a", instead="b", why="c")
    assert report_fallbacks(run_dir, rank=1) == []
    assert capsys.readouterr().err == "" and "fallbacks" not in _launches(run_dir)[-1]
