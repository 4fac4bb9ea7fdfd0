"""`forja prepare --part K --parts N`, then `--merge`, as a user runs them (subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forja.cli import build_parser

from .test_data_cli import error_line, forja

ARGS = ["--source", "corpus", "--tokenizer", "tok.json", "--val-fraction", "0.1", "--shard-tokens", "400",
        "--workers", "1", "--no-progress"]


def test_prepare_options_are_never_abbreviated(capsys: pytest.CaptureFixture) -> None:
    parser = build_parser("prepare")
    base = ["prepare", "--source", "s", "--tokenizer", "t", "--out", "o"]
    args = parser.parse_args([*base, "--part", "1", "--parts", "2", "--workers=3"])
    assert (args.part, args.parts, args.workers, args.merge) == (1, 2, 3, False)
    args = parser.parse_args([*base, "--parts", "2", "--part", "0"])
    assert (args.part, args.parts) == (0, 2)
    for abbreviated in (["--work", "2"], ["--val", "0.1"], ["--merg"], ["--par", "1"], ["--over"]):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args([*base, *abbreviated])
        assert caught.value.code == 2
        assert f"unrecognized arguments: {' '.join(abbreviated)}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parts-cli")
    (root / "corpus").mkdir()
    for i in range(40):
        (root / "corpus" / f"gen{i:02d}.txt").write_text(f"document {i}: " + "δοκιμή and test " * (i % 9 + 1))
    done = forja("tokenizer", "train", "--source", "corpus", "--vocab-size", "300", "--out", "tok.json", cwd=root)
    assert done.returncode == 0, done.stderr
    return root


def test_workers_then_merge_write_what_one_prepare_writes(work: Path) -> None:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    workers = [subprocess.Popen([sys.executable, "-m", "forja", "prepare", *ARGS, "--out", "parted",
                                 "--part", str(k), "--parts", "3"], cwd=work, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in (0, 2)]
    for k, worker in zip((0, 2), workers):  # two workers at once, as in an array job
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        assert out.startswith(f"wrote part {k} of 3 (parted/.parts/0000{k}): ") and "tokens/s" in out
    missing = forja("prepare", *ARGS, "--out", "parted", "--merge", cwd=work)
    assert error_line(missing, "prepare") == (
        "forja prepare: error: part 1 of 3 under parted/.parts is missing or unfinished; run `forja prepare ARGS "
        "--part K --parts 3` for K in 1 (the same ARGS as the other parts), then --merge again")
    rerun = forja("prepare", *ARGS, "--out", "parted", "--part", "1", "--parts", "3", cwd=work)
    assert rerun.returncode == 0, rerun.stderr
    merged = forja("prepare", *ARGS, "--out", "parted", "--merge", cwd=work)
    assert merged.returncode == 0, merged.stderr
    assert "corpus: 40 documents" in merged.stdout and "merged the parts into parted:" in merged.stdout
    single = forja("prepare", *ARGS, "--out", "single", cwd=work)
    assert single.returncode == 0, single.stderr
    files = sorted(p.relative_to(work / "single") for p in (work / "single").rglob("*") if p.is_file())
    assert sorted(p.relative_to(work / "parted") for p in (work / "parted").rglob("*") if p.is_file()) == files
    assert len(files) > 6 and all((work / "single" / f).read_bytes() == (work / "parted" / f).read_bytes()
                                  for f in files)


def test_a_part_out_of_range_is_one_line(work: Path) -> None:
    done = forja("prepare", *ARGS, "--out", "bad", "--part", "3", "--parts", "3", cwd=work)
    assert error_line(done, "prepare") == "forja prepare: error: --part 3 is out of range for --parts 3; give 0 to 2"
    assert not (work / "bad").exists()


def test_slurm_template_submits_the_array_then_a_merge_after_it(tmp_path: Path) -> None:
    """scripts/prepare.sbatch on the login node, with a stand-in sbatch that records its calls."""
    script = Path(__file__).parents[2] / "scripts" / "prepare.sbatch"
    (tmp_path / "sbatch").write_text('#!/bin/bash\necho "$*" >> "$LOG"\necho 4242\n')
    (tmp_path / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "LOG": str(tmp_path / "log")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    array, merge = (tmp_path / "log").read_text().splitlines()
    assert array == f"--parsable --array=0-15 {script} part"
    assert merge == f"--dependency=afterok:4242 --kill-on-invalid-dep=yes --cpus-per-task=2 {script} merge"
    bad = subprocess.run(["bash", str(script), "nonsense"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr
