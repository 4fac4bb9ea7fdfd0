"""`[eval]`: downstream tasks scored during training, on the model as it is laid out; the
figures equal `forja eval` on the run's final checkpoint."""

from __future__ import annotations

import json

import pytest

from forja.cli import main
from forja.eval.tasks import SHIPPED
from tests.distributed.parity import COMMON, SharedLayouts

from .conftest import forja_process, read_metrics, train_args

TASKS = SHIPPED
EVAL = {"eval.tasks": '["python_mc", "python_text"]',  # by name: the samples shipped with forja
        "eval.interval": "4", "train.steps": "8", "train.val_interval": "0", "train.sample_tokens": "0"}
KEYS = ("eval/python-json-mc/acc", "eval/python-json-mc/acc_norm", "eval/python_text/bits_per_byte",
        "eval/python_text/loss")


def _in_loop(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if any(k.startswith("eval/") for k in r)}


def _offline(run, capsys) -> dict[str, float]:
    """`forja eval` on the run's final checkpoint, as eval/<task>/<metric>."""
    capsys.readouterr()
    assert main(["eval", str(run), "--task", str(TASKS / "python_mc.jsonl"), "--task",
                 str(TASKS / "python_text.jsonl"), "--json"]) == 0
    tasks = json.loads(capsys.readouterr().out)["tasks"]
    return {f"eval/{t['task']}/{k}": v for t in tasks for k, v in t.items() if k not in ("task", "kind")}


def test_tasks_are_scored_at_their_interval_and_equal_forja_eval_at_the_end(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, train_data, **EVAL)) == 0
    scored = _in_loop(run)
    assert sorted(scored) == [4, 8]
    assert scored[4]["eval/python_text/bits_per_byte"] > scored[8]["eval/python_text/bits_per_byte"]
    offline = _offline(run, capsys)
    print("1 process vs forja eval, max |diff|:", max(abs(scored[8][k] - offline[k]) for k in KEYS))
    for key in KEYS:
        assert scored[8][key] == pytest.approx(offline[key], abs=1e-6), key


def test_two_fsdp_ranks_split_the_requests_and_agree_with_one_process(tmp_path, train_data, capsys):
    run = tmp_path / "run"
    changes = {**COMMON, **EVAL, "checkpoint.interval": "4"}
    proc = forja_process(train_args(run, train_data, **changes) + ["--nproc", "2"])
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "forja: eval at step 8: python-json-mc/acc" in out
    offline = _offline(run, capsys)
    print("2 ranks vs forja eval, max |diff|:", max(abs(_in_loop(run)[8][k] - offline[k]) for k in KEYS))
    for key in KEYS:
        assert _in_loop(run)[8][key] == pytest.approx(offline[key], abs=1e-5), key


LAYOUTS = {"tp2": {"parallel.tp": "2"}, "pp2": {"parallel.pp": "2"}}


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    """Both layouts train in one 2-rank process group (one start-up rather than one torchrun
    each; the FSDP test above keeps torchrun, whose printed line it reads)."""
    layouts = {name: (2, {**EVAL, "checkpoint.interval": "4", **layout}) for name, layout in LAYOUTS.items()}
    return SharedLayouts(tmp_path_factory, train_data, layouts)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_and_pipeline_parallel_ranks_score_without_gathering_and_agree_with_one_process(
        tmp_path, capsys, layout, shared_runs):
    """Under TP the logits stay sharded over the vocabulary (vocabulary-parallel scoring);
    under PP only the last stage's rank has the scores. Both equal `forja eval` on the
    checkpoint, which loads the weights whole in one process."""
    run = shared_runs.run(layout, tmp_path / "run")
    scored, offline = _in_loop(run), _offline(run, capsys)
    assert sorted(scored) == [4, 8]
    print(f"{LAYOUTS[layout]} vs forja eval, max |diff|:", max(abs(scored[8][k] - offline[k]) for k in KEYS))
    for key in KEYS:
        assert scored[8][key] == pytest.approx(offline[key], abs=1e-5), key
