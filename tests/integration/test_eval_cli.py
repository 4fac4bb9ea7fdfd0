"""`forja eval` end to end: a short run on Python's json package, scored on the sample tasks."""

from __future__ import annotations

import json

import pytest

from forja.cli import main
from forja.eval import evaluate, load_task
from forja.eval.cli import load_model
from forja.eval.tasks import SHIPPED
from forja.models import build_from_args

from .conftest import train_args

TASKS = SHIPPED
MC, TEXT = TASKS / "python_mc.jsonl", TASKS / "python_text.jsonl"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, train_data):
    run = tmp_path_factory.mktemp("eval") / "run"
    assert main(train_args(run, train_data, **{"train.steps": "24", "checkpoint.interval": "12",
                                                "train.val_interval": "24"})) == 0
    return run


def test_eval_of_a_run_prints_json_and_beats_an_untrained_model(trained_run, capsys):
    assert main(["eval", str(trained_run), "--task", str(MC), "--task", str(TEXT), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mc, text = out["tasks"]
    assert mc["task"] == "python-json-mc" and mc["kind"] == "multiple_choice" and mc["n"] == 5
    assert 0 <= mc["acc"] <= 1 and 0 <= mc["acc_norm"] <= 1
    assert text["task"] == "python_text" and text["kind"] == "perplexity" and text["n"] == 4
    assert text["bytes"] == sum(len(json.loads(line)["text"].encode()) for line in TEXT.read_text().splitlines())
    assert text["ppl"] == pytest.approx(2.718281828 ** text["loss"])
    # The same weights, untrained (initialized from the seed): training on the json package's
    # code must make code like it cheaper to encode.
    model, tok, prefix = load_model(trained_run)
    untrained = build_from_args(model.args, seed=0).eval()
    before = evaluate(untrained, tok, load_task(TEXT), prefix_id=prefix)["bits_per_byte"]
    assert text["bits_per_byte"] < 0.9 * before  # measured 3.45 against 4.15 after 24 steps


def test_eval_prints_a_table_and_limit_caps_each_task(trained_run, capsys):
    assert main(["eval", str(trained_run), "--task", str(MC), "--task", str(TEXT), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "python-json-mc" in out and "python_text" in out and "bits/byte" in out
    assert main(["eval", str(trained_run), "--task", str(TEXT), "--limit", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"][0]["n"] == 2


def test_a_bad_task_file_is_one_line_naming_it(trained_run, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n{"context": "a", "choices": ["b"], '
                   '"answer": 3}\n')
    assert main(["eval", str(trained_run), "--task", str(MC), "--task", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad} line 2: \"answer\" is 3" in err and err.count("\n") == 1
    assert main(["eval", str(tmp_path), "--task", str(MC)]) == 2
    assert "is neither a forja run directory" in capsys.readouterr().err
