"""The traps of a user's first hour, end to end as they meet them (subprocesses, real files).

A handful of files through the README's quickstart (validation gets a document), a rerun of a
finished run (says so, appends nothing), an export readable by others (0644), and a full disk
(one sentence naming the file and what was kept).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from forja.checkpoint.export import export_hf
from forja.cli import main
from forja.config import load_config
from forja.data import cache_key, load_tokenizer, open_prepared, train_tokenizer
from forja.errors import ForjaError
from forja.files import read_records, write_atomic
from forja.train.launch.finished import completed_step, finished

# Six small Python files: at the default 1%, none of them hashes into validation.
FILES = {f"m{i}.py": "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(4 + i))
         for i in range(6)}
QUICKSTART = {"data.vocab_size": "300", "model.flavor": '"debug"', "train.steps": "2", "train.seq_len": "32",
              "train.global_batch_size": "2", "train.micro_batch_size": "2", "train.val_interval": "1",
              "train.val_batches": "1", "train.sample_tokens": "4", "metrics.interval": "1",
              "metrics.sinks": '["jsonl"]', "schedule.warmup_steps": "1"}


def forja(*args: str, cwd: Path, file_limit: int | None = None) -> subprocess.CompletedProcess:
    """Run `forja ARGS` in a child; `file_limit`: its largest writable file, in bytes."""
    return python("-m", "forja", *args, cwd=cwd, file_limit=file_limit)


def python(*args: str, cwd: Path, file_limit: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "FORJA_CACHE": str(cwd / "cache")}

    def limit() -> None:  # runs in the child: the write fails with EFBIG instead of a SIGXFSZ kill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, preexec_fn=limit if file_limit is not None else None)


def error_line(done: subprocess.CompletedProcess, command: str) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith(f"forja {command}: error: ")]
    return line.removeprefix(f"forja {command}: error: ")


def quickstart(**changes: str) -> list[str]:
    sets = {"run.dir": '"runs/mine"', "data.path": '"code/*.py"', **QUICKSTART, **changes}
    return [f"{k}={v}" for k, v in sets.items()]


def train(work: Path) -> subprocess.CompletedProcess:
    return forja("train", *(a for item in quickstart() for a in ("--set", item)), cwd=work)


def write_code(folder: Path) -> None:
    folder.mkdir()
    for name, text in FILES.items():
        (folder / name).write_text(text)


def snapshot(run: Path) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart on six files: `forja train` on the source (tokenizer and data made on
    first use, in a cache of this test's own), two steps."""
    root = tmp_path_factory.mktemp("first-hour")
    write_code(root / "code")
    done = train(root)
    assert done.returncode == 0, done.stdout + done.stderr
    records = read_records(root / "runs" / "mine" / "metrics.jsonl", strict=True)
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2]
    return root


def test_a_handful_of_files_gets_a_validation_split(work: Path) -> None:
    (cached,) = (work / "cache" / "prepared").iterdir()  # what `forja train` prepared
    assert open_prepared(cached).num_documents("val") == 1
    tok = forja("tokenizer", "train", "--source", "code", "--vocab-size", "300", "--out", "tok.json", cwd=work)
    assert tok.returncode == 0, tok.stderr
    done = forja("prepare", "--source", "code", "--tokenizer", "tok.json", "--out", "data", "--no-progress", cwd=work)
    assert done.returncode == 0, done.stderr
    ds = open_prepared(work / "data")
    assert (ds.num_documents("train"), ds.num_documents("val")) == (5, 1)
    assert f"code: 6 documents (train 5 documents / {ds.num_tokens('train'):,} tokens, val 1 / " in done.stdout


def test_a_source_too_small_for_validation_stops_before_the_run_is_written(tmp_path: Path) -> None:
    """A source whose validation split holds no sample of train.seq_len + 1 tokens is refused
    before run.dir is written (it is prepared into the cache first, then checked), so the fix
    the sentence suggests (a larger data.val_fraction) is not refused as another run's directory,
    and no launch or restart was recorded."""
    write_code(tmp_path / "code")
    longer = {"train.seq_len": "96"}
    refused = forja("train", *(a for item in quickstart(**longer) for a in ("--set", item)), cwd=tmp_path)
    assert "the validation split of code/*.py has" in error_line(refused, "train")
    assert "data.val_fraction" in refused.stderr and not (tmp_path / "runs").exists()
    fix = quickstart(**longer, **{"data.val_fraction": "0.5"})
    fixed = forja("train", *(a for item in fix for a in ("--set", item)), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    launches = json.loads((tmp_path / "runs" / "mine" / "run.json").read_text())["launches"]
    assert len(launches) == 1


def test_a_finished_run_says_so_and_appends_nothing(work: Path) -> None:
    run = work / "runs" / "mine"
    before = snapshot(run)
    assert {"metrics.jsonl", "goodput.json", "run.json", "samples.jsonl"} <= set(before)
    done = train(work)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "forja: runs/mine is complete at step 2 of 2; give more train.steps to train further\n"
    assert snapshot(run) == before


def test_only_the_same_run_at_its_steps_is_complete(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(work)
    assert completed_step(load_config("default", quickstart())) == 2
    assert completed_step(load_config("default", quickstart(**{"train.steps": "3"}))) is None  # trains on
    assert completed_step(load_config("default", quickstart(**{"run.start_over": "true"}))) is None
    # Another run in that directory: RunDir.prepare refuses it, naming the difference.
    assert completed_step(load_config("default", quickstart(**{"train.seed": "7"}))) is None
    # A byte flipped in the newest checkpoint (its size unchanged): resume goes back, so not complete.
    copy = shutil.copytree(work / "runs" / "mine", work / "runs" / "flipped")
    shard = copy / "checkpoints" / "step-00000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert completed_step(load_config("default", quickstart(**{"run.dir": '"runs/flipped"'}))) is None
    assert finished(load_config("default", quickstart(**{"train.steps": "1"})))
    assert capsys.readouterr().out == ("forja: runs/mine is complete at step 2 (train.steps = 1); give more "
                                       "train.steps to train further\n")


def test_an_export_is_readable_by_others(work: Path) -> None:
    old = os.umask(0o022)
    try:
        out = export_hf(work / "runs" / "mine", work / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is Linux's always-full device")
def test_write_atomic_on_a_full_disk_keeps_the_previous_file(tmp_path: Path) -> None:
    """A real ENOSPC: /dev/full accepts an open and refuses every write with ENOSPC. The
    temporary name write_atomic writes first is made a link to it, so the write meets a full
    device exactly where a full disk would refuse it."""
    target = tmp_path / "run.json"
    write_atomic(target, "previous\n")
    (tmp_path / f".run.json.tmp-{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(ForjaError) as caught:
        write_atomic(target, "x" * 100_000)
    assert str(caught.value) == (f"no space left on device writing {target}: nothing is half-written (the previous "
                                 "run.json is kept whole); free some space on that disk and run again")
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert target.read_text() == "previous\n" and os.listdir(tmp_path) == ["run.json"]


def test_prepare_and_tokenizer_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real EFBIG: RLIMIT_FSIZE caps the child's files at 4 KiB (SIGXFSZ ignored, so the write
    that crosses the cap fails with EFBIG, as a full disk's fails with ENOSPC, instead of killing
    it). The tokens of six files and a 300-token tokenizer.json are each larger than that."""
    write_code(tmp_path / "code")
    train_tokenizer(str(tmp_path / "code"), vocab_size=300, out=tmp_path / "tok.json")
    args = ("prepare", "--source", "code", "--tokenizer", "tok.json", "--no-progress")
    assert error_line(forja(*args, "--out", "full", cwd=tmp_path, file_limit=4096), "prepare") == (
        "no space left on device writing full (File too large): nothing is half-written (nothing was left "
        "behind); free some space, or give another --out")
    assert not any(p.name.startswith(("full", ".full")) for p in tmp_path.iterdir())

    assert forja(*args, "--out", "data", cwd=tmp_path).returncode == 0
    before = snapshot(tmp_path / "data")
    again = forja(*args, "--out", "data", "--overwrite", cwd=tmp_path, file_limit=4096)
    assert "(the previous data is kept whole)" in error_line(again, "prepare")
    assert snapshot(tmp_path / "data") == before

    # Prepared on first use (forja train's way): the cache is named, and how to move it.
    cached = python("-c", "from forja.data import open_dataset\ntry:\n open_dataset('code', 'tok.json')\n"
                    "except OSError as e:\n print(e)", cwd=tmp_path, file_limit=4096)
    monkeypatch.chdir(tmp_path)  # the key of the spec 'code' as the child saw it
    key = cache_key("code", load_tokenizer(tmp_path / "tok.json"))
    assert cached.stdout == (f"no space left on device writing the prepared copy of code in {tmp_path}/cache/"
                             f"prepared/{key} (File too large): nothing is half-written (nothing was left behind); "
                             "free some space, or set FORJA_CACHE to a disk with room\n"), cached.stderr
    assert list((tmp_path / "cache" / "prepared").iterdir()) == []

    tok_before = (tmp_path / "tok.json").read_bytes()
    done = forja("tokenizer", "train", "--source", "code", "--vocab-size", "300", "--out", "tok.json", "--overwrite",
                 cwd=tmp_path, file_limit=4096)
    assert error_line(done, "tokenizer") == (
        "no space left on device writing tok.json (File too large): nothing is half-written (the previous "
        "tok.json is kept whole); free some space on that disk and run again")
    assert (tmp_path / "tok.json").read_bytes() == tok_before


class _RefuseComet:
    """An import hook that refuses comet_ml, as a machine without the package would."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "comet_ml":
            raise ModuleNotFoundError(f"No module named {name!r}")


def test_settings_a_worker_would_refuse_leave_no_run_directory(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Two launches the preflight refuses before anything is written: context parallelism with the
    attention-logit metric (the layout validator, in the launcher before torchrun starts), and a
    tracker whose package is missing."""
    monkeypatch.chdir(work)
    monkeypatch.setenv("FORJA_CACHE", str(work / "cache"))  # the quickstart's (the fixture's children used it)
    sets = quickstart(**{"run.dir": '"runs/cp"', "parallel.cp": "2", "optim.max_logit_metric": "true"})
    assert main(["train", "--nproc", "2", *(a for item in sets for a in ("--set", item))]) == 2
    assert "optim.qk_clip_tau / optim.max_logit_metric cannot be used with parallel.cp > 1" in capsys.readouterr().err
    monkeypatch.setattr(sys, "meta_path", [_RefuseComet(), *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "comet_ml"]:
        monkeypatch.delitem(sys.modules, name)
    sets = quickstart(**{"run.dir": '"runs/comet"', "metrics.sinks": '["jsonl", "comet"]'})
    assert main(["train", *(a for item in sets for a in ("--set", item))]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "forja train: error: metrics.sinks includes 'comet', which needs the comet_ml package: "
        "pip install 'forja[comet]' (or remove 'comet' from metrics.sinks)")
    assert not (work / "runs" / "cp").exists() and not (work / "runs" / "comet").exists()
