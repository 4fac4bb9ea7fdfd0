"""`forja train` reports every requested fast path it does not take (forja/fallbacks.py):
one line at start on rank 0, and the launch's entry of run.json. On a CPU,
`model.attention = "flex"` runs SDPA (FlexAttention has no CPU backward): a fallback recorded
while step 1 runs, reported right after it; one first met at a later step, after that step; a run
whose requests the CPU honours lists none."""

from __future__ import annotations

import json

from forja import fallbacks
from forja.cli import main
from forja.config import load_config
from forja.train.callbacks import Callback
from forja.train.trainer import Trainer

from .conftest import base_overrides, train_args

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


class _DeclinesAtStep3(Callback):
    """A fast path that declines on what some later step brings (as a kernel given a new shape
    would): recorded at the end of step 3."""

    def on_step_end(self, trainer, record) -> None:
        if record.step == 3:
            fallbacks.record("test.late", asked="a fast path", instead="the slow one", why="step 3's tensors")


def test_a_fallback_first_met_after_step_1_is_reported_at_the_next_step(tmp_path, train_data, capsys):
    run = tmp_path / "late"
    cfg = load_config("debug", base_overrides(run, train_data, **{**SHORT, "train.steps": "5"}))
    Trainer(cfg, callbacks=[_DeclinesAtStep3()]).run()
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forja: fallback:")]
    assert printed == ["forja: fallback: a fast path -> the slow one (step 3's tensors)"]
    assert [f["key"] for f in _fallbacks(run)] == ["test.late"]
