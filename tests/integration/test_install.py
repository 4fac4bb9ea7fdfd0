"""`make train`'s install of forja itself prints no boxed warnings (setuptools prints one for
every editable install, and printed four for the project's old license fields).

The install line is read from `make -n` (what `make train` runs), with its venv's python swapped
for a fresh venv's whose pip is upgraded as the Makefile does, and `--no-deps` (the dependencies
are not what is tested, and they are large). It builds forja as `make train` does: in an
isolated build environment with the setuptools pyproject.toml asks for.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def install_line() -> list[str]:
    dry = subprocess.run(["make", "-n", "-B", ".venv/.installed-train"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert dry.returncode == 0, dry.stderr
    (line,) = [ln for ln in dry.stdout.splitlines() if "pip install" in ln and " -e ." in ln]
    return shlex.split(line)


def test_the_editable_install_prints_no_box(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True, timeout=300,
                   capture_output=True)
    words = install_line()
    env_words = [w for w in words if "=" in w and w.split("=")[0].isupper()]  # VAR=value before the command
    command = [python if w.endswith("/bin/python") else w for w in words[len(env_words):]] + ["--no-deps"]
    env = dict(w.split("=", 1) for w in env_words)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    printed = done.stdout + done.stderr
    assert "!!" not in printed and "*****" not in printed and "Deprecat" not in printed, printed
