"""Datasets of the local harness tasks, read from the task samples shipped with forja (forja/eval/data).

lm_eval calls a task's `custom_dataset` with the run's metadata (model_args included) as
keyword arguments, hence **_: none of them changes the data. Building the dataset in memory
keeps the harness off the network and the tasks independent of the working directory (a
`dataset_path: json` task resolves relative data_files against the current directory).
"""

import json

import datasets

from forja.eval.tasks import SHIPPED


def _rows(name):
    lines = (SHIPPED / name).read_text().splitlines()
    # forja's task files may start with a header line ({"task": ..., "kind": ...}): not an example.
    return [row for row in map(json.loads, lines) if "task" not in row]


def python_mc(**_):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("python_mc.jsonl"))})


def python_text(**_):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("python_text.jsonl"))})


def python_gen(**_):
    # A generation task on the same code: continue each multiple-choice context.
    rows = [{"context": r["context"], "answer": r["choices"][r["answer"]]} for r in _rows("python_mc.jsonl")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
