"""A small prepared corpus (stdlib's json package, a 512-token tokenizer) and helpers to
run `forja train` on it, in this process or in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forja.data import prepare, train_tokenizer
from forja.files import read_records


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """A prepared directory (with its tokenizer.json inside) of real Python code."""
    root = tmp_path_factory.mktemp("train-data")
    tok = train_tokenizer("stdlib:json", vocab_size=512, out=root / "tokenizer.json")
    prepare("stdlib:json", tok, root / "prepared", val_fraction=0.2, workers=1)
    return root / "prepared"


def base_overrides(run_dir: Path, data: Path, **changes) -> list[str]:
    """--set values for a seconds-long debug run; `changes` maps 'section.key' to TOML text."""
    values = {
        "run.dir": json.dumps(str(run_dir)),
        "data.path": json.dumps(str(data)),
        "model.flavor": '"debug"',
        "train.steps": "12",
        "train.seq_len": "64",
        "train.global_batch_size": "8",
        "train.micro_batch_size": "4",
        "train.val_interval": "6",
        "train.val_batches": "2",
        "train.sample_tokens": "8",
        "checkpoint.interval": "4",
        "metrics.interval": "1",
        "metrics.sinks": '["jsonl"]',
        "schedule.warmup_steps": "2",
    }
    values.update(changes)
    return [f"{k}={v}" for k, v in values.items()]


def train_args(run_dir: Path, data: Path, **changes) -> list[str]:
    args = ["train", "debug"]
    for item in base_overrides(run_dir, data, **changes):
        args += ["--set", item]
    return args


def forja_process(args: list[str], *, drop_env: tuple[str, ...] | list[str] = (), **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in drop_env} | {"PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "forja", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


def read_metrics(run_dir: Path) -> list[dict]:
    return read_records(run_dir / "metrics.jsonl", strict=True)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll `predicate` until it holds; fail with the process's output if it exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def kill_then_resume(run: Path, args: list[str], *, kill_at: int, last: int) -> None:
    """`forja train args` killed with SIGKILL (no handler runs, whatever was being written is
    left as it is) once step `kill_at`'s checkpoint is on disk, before step `last`'s; then the
    same command again, which must resume and finish."""
    proc = forja_process(args)
    wait_for(lambda: (run / "checkpoints" / f"step-{kill_at:08d}").is_dir(), proc)
    proc.kill()
    proc.wait()
    assert not (run / "checkpoints" / f"step-{last:08d}").exists(), "the run finished before it was killed"
    resumed = forja_process(args)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resumed from" in out
