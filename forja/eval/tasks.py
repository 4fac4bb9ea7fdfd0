"""Downstream task files: local JSONL, one example per line (the format is in docs/evaluation.md).

    {"task": "python-mc", "kind": "multiple_choice"}          <- optional header line
    {"context": "import json\\n", "choices": ["x = json.loads(s)", "x = json.sing(s)"], "answer": 0}

    {"text": "def dumps(obj):\\n    return JSONEncoder().encode(obj)\\n"}

The kind is the header's `kind`; without a header it is read from the first example's fields
("choices" -> multiple_choice, "text" -> perplexity), and every later line must match it.
Each bad line stops the load with one sentence naming the file, the line and the fix.

A task is given by path, or by name: a file's stem or its header's task name, looked up in
the directories of $FORJA_TASK_PATH (os.pathsep-separated, searched first) and then among
the samples shipped in forja/eval/data (`load_task("python_mc")`, `forja eval RUN --task
python-json-mc`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from forja.errors import ForjaError

MULTIPLE_CHOICE, PERPLEXITY = "multiple_choice", "perplexity"
KINDS = (MULTIPLE_CHOICE, PERPLEXITY)
SHIPPED = Path(__file__).parent / "data"  # the task samples installed with forja
TASK_PATH = "FORJA_TASK_PATH"


@dataclass(frozen=True)
class Choice:
    """One multiple-choice question: the model scores each `choices[i]` as a continuation of `context`."""

    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class Text:
    """One text whose every token is scored (perplexity, bits per byte)."""

    text: str


@dataclass(frozen=True)
class Task:
    """A task file, parsed: its name, kind and examples in file order."""

    name: str
    kind: str
    path: Path
    examples: tuple[Choice, ...] | tuple[Text, ...]


def _where(path: Path, line: int) -> str:
    return f"{path} line {line}"


def _parse_choice(record: dict, where: str) -> Choice:
    context, choices, answer = record.get("context"), record.get("choices"), record.get("answer")
    if not isinstance(context, str):
        raise ForjaError(f"{where}: \"context\" must be a string (it is {context!r:.40}); "
                         "give each multiple-choice line {\"context\": str, \"choices\": [str, ...], \"answer\": int}")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ForjaError(f"{where}: \"choices\" must be a list of strings; give the candidate continuations "
                         "as [\"...\", \"...\"]")
    if not choices:
        raise ForjaError(f"{where}: \"choices\" is empty; give at least one candidate continuation")
    if any(c == "" for c in choices):
        raise ForjaError(f"{where}: a choice is the empty string, which has no tokens to score; "
                         "give each choice some text")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ForjaError(f"{where}: \"answer\" is {answer!r}, but it must be the index of the right choice, "
                         f"an integer from 0 to {len(choices) - 1}; fix the answer")
    return Choice(context=context, choices=tuple(choices), answer=answer)


def _parse_text(record: dict, where: str) -> Text:
    text = record.get("text")
    if not isinstance(text, str) or not text:
        raise ForjaError(f"{where}: \"text\" must be a non-empty string; give each perplexity line "
                         "{\"text\": \"...\"}")
    return Text(text=text)


def _read_lines(path: Path) -> list[tuple[int, dict]]:
    """(line number, JSON object) of each non-blank line."""
    if not path.is_file():
        raise ForjaError(f"task file {path} does not exist; give a JSONL task file (see docs/evaluation.md)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ForjaError(f"{_where(path, number)} is not valid JSON ({exc.msg}); "
                             "write one JSON object per line") from exc
        if not isinstance(record, dict):
            raise ForjaError(f"{_where(path, number)} is not a JSON object; write one {{...}} object per line")
        records.append((number, record))
    return records


def _header(records: list[tuple[int, dict]], path: Path) -> tuple[str, str | None, list[tuple[int, dict]]]:
    """(task name, declared kind or None, the example lines) of a file's lines."""
    name = path.stem
    if records and "kind" in records[0][1]:
        number, head = records[0]
        kind = head["kind"]
        if kind not in KINDS:
            raise ForjaError(f"{_where(path, number)}: kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
        return str(head.get("task", name)), kind, records[1:]
    return name, None, records


def task_dirs() -> list[Path]:
    """Where task names are looked up, in order: $FORJA_TASK_PATH's directories, then the shipped samples."""
    extra = [Path(d).expanduser() for d in os.environ.get(TASK_PATH, "").split(os.pathsep) if d]
    return [*extra, SHIPPED]


def _declared_name(path: Path) -> str | None:
    """The task name of a file's header line, when its first line is one."""
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        return None
    return str(head["task"]) if isinstance(head, dict) and "kind" in head and "task" in head else None


def known_tasks() -> dict[str, Path]:
    """Every task name -> its file: each file's stem and header name, the first directory winning."""
    found: dict[str, Path] = {}
    for folder in task_dirs():
        for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
            for name in (path.stem, _declared_name(path)):
                if name:
                    found.setdefault(name, path)
    return found


def resolve_task(path_or_name: str | os.PathLike) -> Path:
    """The file of a task given by path or by name."""
    path = Path(path_or_name).expanduser()
    if path.is_file() or path.suffix == ".jsonl" or len(path.parts) > 1:
        return path  # a path (a missing one gets load_task's message)
    known = known_tasks()
    if str(path_or_name) not in known:
        raise ForjaError(f"task {str(path_or_name)!r} is neither a file nor a known task name; give a JSONL file, "
                         f"or one of: {', '.join(sorted(known)) or 'none'} (from ${TASK_PATH} and {SHIPPED})")
    return known[str(path_or_name)]


def check_tasks(tasks: list[str]) -> None:
    """That each of eval.tasks names a task file (the preflight's check, before any work)."""
    for task in tasks:
        try:
            path = resolve_task(task)
        except ForjaError as exc:
            raise ForjaError(f"eval.tasks: {exc}") from None
        if not path.is_file():
            raise ForjaError(f"eval.tasks: {task} is not a file; give JSONL task files or task names "
                             "(docs/evaluation.md)")


def load_task(path_or_name: str | os.PathLike, *, limit: int | None = None) -> Task:
    """Parse a JSONL task file, given by path or by name; `limit` keeps its first examples only."""
    path = resolve_task(path_or_name)
    name, kind, records = _header(_read_lines(path), path)
    if not records:
        raise ForjaError(f"task file {path} has no examples; add one JSON object per line (see docs/evaluation.md)")
    if kind is None:
        first = records[0][1]
        if "choices" in first:
            kind = MULTIPLE_CHOICE
        elif "text" in first:
            kind = PERPLEXITY
        else:
            raise ForjaError(f"{_where(path, records[0][0])} has neither \"choices\" (multiple choice) nor "
                             "\"text\" (perplexity); give one, or a header line {\"kind\": ...}")
    parse = _parse_choice if kind == MULTIPLE_CHOICE else _parse_text
    examples = [parse(record, _where(path, number)) for number, record in records[:limit]]
    return Task(name=name, kind=kind, path=path, examples=tuple(examples))
