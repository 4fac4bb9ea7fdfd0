"""The README's commands work as written.

Every `$ ` line of the README's code blocks is run exactly as it is printed, in order, in one
temporary directory (so the quickstart's later commands find the run its first one trained),
with the venv's bin/ on PATH and FORJA_CACHE in a temporary cache: `forja ...` lines as they
are, a `source .venv/bin/activate` line in a directory whose .venv is this venv (it must put
this venv's `forja` first on PATH). The README's output lines that do not depend on the machine
(`step ...`, `forja...`, `wrote ...` lines, with every number read as "a number") must appear in
what the command printed. The `make` lines at the top are checked with `make -n` in the clone
(running them is the install and the whole suite). A `$` line of any other kind fails: the
README may show only commands this test runs. The ```python blocks run last, in the same
directory (the API block reads the export and the prepared data the commands made).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
VENV = Path(sys.prefix)  # the venv running the tests (make test's .venv)
NUMBER = re.compile(r"\d[\d,.e+-]*")
CHECKED = ("step ", "forja", "wrote ")  # output lines that must reappear (numbers aside)


@dataclass
class Command:
    text: str
    output: list[str] = field(default_factory=list)


def code_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = [] if line.strip() in ("```", "```console", "```shell", "```bash") else None
                if current is None:  # a ```python block: not commands
                    current = False
            else:
                if current is not False:
                    blocks.append(current)
                current = None
        elif current not in (None, False):
            current.append(line)
    return blocks


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of the README, each as one program."""
    blocks, current = [], None
    for line in text.splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.startswith("```"):
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def readme_commands(text: str) -> list[Command]:
    """The `$ ` lines of the README (a trailing backslash joins the next line), each with the
    lines printed under it."""
    commands = []
    for block in code_blocks(text):
        continued = False
        for line in block:
            if continued:
                commands[-1].text += " " + line.strip()
            elif line.startswith("$ "):
                commands.append(Command(line[2:].strip()))
            elif commands and line.strip():
                commands[-1].output.append(line)
            continued = line.rstrip().endswith("\\")
            if continued:
                commands[-1].text = commands[-1].text.rstrip().removesuffix("\\").rstrip()
    return commands


def make_targets(text: str) -> list[str]:
    """The targets of the `make X` lines of the README's first code block."""
    first = code_blocks(text)[0]
    return [line.split()[1] for line in first if line.startswith("make ")]


COMMANDS = readme_commands(README.read_text())
# The commands run once, in the first test's setup: on a busy 2-core machine that took 223 s.
pytestmark = pytest.mark.timeout(900)


def shape(line: str) -> str:
    return NUMBER.sub("#", line.strip())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def ran(work) -> list[subprocess.CompletedProcess]:
    """Every README command, run once, in order, in one directory."""
    (work / ".venv").symlink_to(VENV)
    # One thread: a 2-core machine shared with other jobs runs forja's small models several
    # times slower when two threads per process fight them for the cores.
    env = {**os.environ, "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "FORJA_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("VIRTUAL_ENV", None)
    results = []
    for command in COMMANDS:
        script = command.text
        if command.text.startswith("source "):
            # Activation must bring forja itself: run it from a PATH without the venv.
            script = f"{command.text} && command -v forja"
            cmd_env = {**env, "PATH": os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                                       if Path(p).resolve() != (VENV / "bin").resolve())}
        else:
            cmd_env = env
        results.append(subprocess.run(["bash", "-c", script], cwd=work, env=cmd_env, capture_output=True,
                                      text=True, timeout=400))
    return results


def test_the_readme_has_the_quickstart():
    kinds = [c.text.split()[0] for c in COMMANDS]
    assert "source" in kinds and kinds.count("forja") >= 5
    assert any(c.text.startswith("forja train") for c in COMMANDS)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c.text[:60] for c in COMMANDS])
def test_readme_command(ran, index):
    command, result = COMMANDS[index], ran[index]
    assert command.text.split()[0] in ("forja", "source"), f"the README shows a command no test runs: {command.text}"
    printed = result.stdout + result.stderr
    assert result.returncode == 0, f"$ {command.text}\n{printed[-3000:]}"
    if command.text.startswith("source "):
        assert Path(result.stdout.split()[-1]).resolve() == (VENV / "bin" / "forja").resolve()
    shapes = {shape(line) for line in printed.splitlines()}
    expected = [line for line in command.output if line.startswith(CHECKED) and "cached in" not in line]
    missing = [line for line in expected if shape(line) not in shapes]
    assert missing == [], f"$ {command.text}\nthe README shows lines it did not print:\n" + "\n".join(missing) + \
        f"\n--- it printed:\n{printed[-3000:]}"


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_readme_python_block(ran, work, index):
    """The Python API block runs as printed, in the directory the commands above it left (it
    reads their export and prepared data)."""
    code = python_blocks(README.read_text())[index]
    done = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{code}\n--- printed:\n{(done.stdout + done.stderr)[-3000:]}"


WRITES = re.compile(r"(?:run\.dir=|--hf |--out )(\S+)")


def test_what_the_readme_writes_is_ignored_by_git():
    """A user who follows the README inside the clone finds `git status` clean: every directory
    its commands and its Python block write (run.dir, --hf, --out, the block's save) is ignored."""
    paths = {m.group(1) for c in COMMANDS for m in WRITES.finditer(c.text)}
    code = "\n".join(python_blocks(README.read_text()))
    paths |= set(re.findall(r'save_hf_checkpoint\(\w+, "([^"]+)"\)', code))
    paths.add("report/loss.png")  # where forja report draws several runs by default
    assert {"runs/quickstart", "hf/quickstart", "data/json", "hf/copy"} <= paths
    done = subprocess.run(["git", "check-ignore", "--no-index", *sorted(paths)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert sorted(done.stdout.split()) == sorted(paths), done.stderr


@pytest.mark.parametrize("target", make_targets(README.read_text()))
def test_readme_make_target(target):
    dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert {"train": "forja train", "test": "pytest"}[target] in dry.stdout


def test_the_parser_reads_commands_and_their_output():
    text = "x\n```\n$ forja a \\\n    --b 1\nstep 1 | loss 2.5\n$ forja c\n```\n```python\n$ no\n```\n"
    assert python_blocks(text) == ["$ no"]
    commands = readme_commands(text)
    assert [(c.text, c.output) for c in commands] == [("forja a --b 1", ["step 1 | loss 2.5"]), ("forja c", [])]
    assert shape("step 10/40 | lr 2.02e-03 | 1,290 tok/s") == shape("step 20/40 | lr 3.00e-04 | 15 tok/s")
