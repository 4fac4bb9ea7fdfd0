"""`forja train` reports every requested fast path it does not take (forja/fallbacks.py):
one line at start on rank 0, and the launch's entry of run.json. On a CPU,
`model.attention = "flex"` runs SDPA (FlexAttention has no CPU backward): a fallback recorded
while step 1 runs, reported right after it; a run whose requests the CPU honours lists none."""

from __future__ import annotations

import json

from forja.cli import main

from .conftest import train_args

SHORT = {"train.steps": "2", "train.val_interval": "0", "train.sample_tokens": "0", "checkpoint.interval": "0",
         "model.document_mask": "true"}
FLEX_LINE = 'forja: fallback: model.attention = "flex" -> SDPA (FlexAttention has no backward on cpu); train on CUDA'


def _fallbacks(run) -> list[dict]:
    return json.loads((run / "run.json").read_text())["launches"][-1]["fallbacks"]


def test_flex_on_cpu_is_reported_once_and_kept_in_run_json(tmp_path, train_data, capsys):
    run = tmp_path / "flex"
    assert main(train_args(run, train_data, **SHORT, **{"model.attention": '"flex"'})) == 0
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forja: fallback:")]
    assert printed == [FLEX_LINE]
    assert _fallbacks(run) == [{"key": "attention.flex", "asked": 'model.attention = "flex"', "instead": "SDPA",
                                "why": "FlexAttention has no backward on cpu", "fix": "train on CUDA"}]
    # The next run in this process starts from an empty record. The fused ops' references on a CPU
    # are their documented choice there, not a fallback: it lists nothing.
    other = tmp_path / "sdpa"
    assert main(train_args(other, train_data, **SHORT, **{"model.fused_ops": "true"})) == 0
    assert "forja: fallback:" not in capsys.readouterr().err
    assert _fallbacks(other) == []
