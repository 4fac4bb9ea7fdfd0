"""bench/mixers.py at tiny widths and 64 tokens: every mixer pair is built (transformers' layer,
forja's read from its checkpoint), checked to compute the same outputs and input gradients,
timed, and its memory counted; the table and the JSON hold every mixer. No timing or memory
level is asserted: bench/RESULTS.md has the measured figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

pytest.importorskip("transformers")
import mixers  # noqa: E402


def test_every_mixer_is_checked_equal_then_timed_and_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "mixers.json"
    result = mixers.main(["--tiny", "--tokens", "64", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert [r["mixer"] for r in rows] == list(mixers.MIXERS)
    for r in rows:
        assert r["T"] == 64 and r["forja_skipped"] is None, r
        assert r["equal_output"] and r["out_rel_diff"] < 1e-4 and r["grad_rel_diff"] < 1e-4, r
        assert r["out_max"] > 0, r  # the equal-output check compared outputs of some size
        for side in ("forja", "transformers"):
            assert r[f"{side}_tokens_s"] > 0 and r[f"{side}_saved_bytes"] > 0 and r[f"{side}_peak_bytes"] > 0, r
        assert r["ratio"] > 0
    lines = result["table"].splitlines()
    assert len(lines) == 2 + len(mixers.MIXERS)
    assert all("| yes (" in line for line in lines[2:])  # the table says the check ran
    assert set(result["meta"]["shapes"]) == set(mixers.MIXERS)


def test_forja_dsas_memory_estimate_grows_as_the_square_of_the_length():
    """Masked attention: 4x the bytes at twice the tokens; the published shape's 8k row fits the default limit."""
    spec = mixers._specs(tiny=False)["dsa"]
    assert mixers.sparse_mla_bytes(spec.config, 8192) == 4 * mixers.sparse_mla_bytes(spec.config, 4096)
    assert mixers.sparse_mla_bytes(spec.config, 8192) < 16 * 2**30
