"""The task file parser: good files load, each kind of bad line stops with its own sentence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forja.errors import ForjaError
from forja.eval.config import EvalConfig
from forja.eval.tasks import MULTIPLE_CHOICE, PERPLEXITY, SHIPPED, TASK_PATH, Choice, Text, check_tasks, load_task

DATA = SHIPPED


def write(tmp_path: Path, *lines, name: str = "task.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_the_shipped_samples_load():
    mc = load_task(DATA / "python_mc.jsonl")
    assert (mc.name, mc.kind, len(mc.examples)) == ("python-json-mc", MULTIPLE_CHOICE, 5)
    assert mc.examples[0] == Choice(context="import json\n\ndata = json.",
                                    choices=("loads(text)", "sing(text)", "purple(text)"), answer=0)
    text = load_task(DATA / "python_text.jsonl")
    assert (text.name, text.kind, len(text.examples)) == ("python_text", PERPLEXITY, 4)
    assert text.examples[0].text.startswith("def loads(s, *")


def test_tasks_are_found_by_file_stem_or_header_name_and_the_task_path_comes_first(tmp_path, monkeypatch):
    monkeypatch.delenv(TASK_PATH, raising=False)
    assert load_task("python_mc").path == load_task("python-json-mc").path == DATA / "python_mc.jsonl"
    mine = write(tmp_path, {"task": "mine", "kind": "perplexity"}, {"text": "abc"}, name="python_text.jsonl")
    monkeypatch.setenv(TASK_PATH, f"{tmp_path / 'missing'}{os.pathsep}{tmp_path}")
    assert load_task("python_text").path == mine  # $FORJA_TASK_PATH before the shipped samples
    assert load_task("mine").examples == (Text("abc"),)
    with pytest.raises(ForjaError, match="task 'hellaswag' is neither a file nor a known task name; give a JSONL "
                                         "file, or one of: mine, python-json-mc, python_mc, python_text"):
        load_task("hellaswag")
    with pytest.raises(ForjaError, match="task file .*nope.jsonl does not exist"):
        load_task("nope.jsonl")  # a path, not a name


def test_kind_is_inferred_without_a_header_and_limit_keeps_the_first(tmp_path):
    path = write(tmp_path, {"text": "a"}, "", {"text": "b"}, {"text": "c"})
    task = load_task(path, limit=2)
    assert task.kind == PERPLEXITY and task.examples == (Text("a"), Text("b"))
    mc = load_task(write(tmp_path, {"context": "", "choices": ["x", "y"], "answer": 1}, name="m.jsonl"))
    assert mc.kind == MULTIPLE_CHOICE and mc.examples[0].answer == 1


@pytest.mark.parametrize("lines, message", [
    (['{"context": "a", "choices": ["b"], "answer": 0}', "{not json"], "task.jsonl line 2 is not valid JSON"),
    (["[1, 2]"], "task.jsonl line 1 is not a JSON object"),
    ([{"context": "a", "choices": ["b", "c"], "answer": 2}],
     "task.jsonl line 1: \"answer\" is 2, but it must be the index of the right choice, an integer from 0 to 1"),
    ([{"context": "a", "choices": ["b"], "answer": True}], "\"answer\" is True"),
    ([{"context": "a", "choices": [], "answer": 0}], "task.jsonl line 1: \"choices\" is empty"),
    ([{"context": "a", "choices": ["b", ""], "answer": 0}], "a choice is the empty string"),
    ([{"context": "a", "choices": "b", "answer": 0}], "\"choices\" must be a list of strings"),
    ([{"context": 3, "choices": ["b"], "answer": 0}], "\"context\" must be a string"),
    ([{"context": "a", "choices": ["b"], "answer": 0}, {"text": "t"}], "task.jsonl line 2: \"context\" must be"),
    ([{"kind": "perplexity"}, {"text": ""}], "task.jsonl line 2: \"text\" must be a non-empty string"),
    ([{"kind": "cloze"}, {"text": "a"}], "task.jsonl line 1: kind 'cloze' is unknown; use one of"),
    ([{"prompt": "a"}], "task.jsonl line 1 has neither \"choices\" (multiple choice) nor \"text\""),
    ([{"task": "t", "kind": "perplexity"}, ""], "has no examples"),
])
def test_each_bad_input_names_the_line_and_the_fix(tmp_path, lines, message):
    path = write(tmp_path, *lines)
    with pytest.raises(ForjaError) as err:
        load_task(path)
    assert message in str(err.value)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(ForjaError, match="task file .*nope.jsonl does not exist; give a JSONL task file"):
        load_task(tmp_path / "nope.jsonl")


def test_the_config_holds_task_names_and_the_preflight_checks_they_exist(tmp_path):
    assert EvalConfig(tasks=["no_such_task"]).tasks == ["no_such_task"]  # a value: no filesystem at load
    check_tasks(["python_mc", str(SHIPPED / "python_text.jsonl")])
    with pytest.raises(ForjaError, match="eval.tasks: task 'no_such_task' is neither a file nor a known task"):
        check_tasks(["no_such_task"])
    with pytest.raises(ForjaError, match="eval.tasks: .*sub is not a file; give JSONL task files or task names"):
        check_tasks([str(tmp_path / "sub")])
