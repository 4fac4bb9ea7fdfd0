"""bench/gpu_check.py (`make gpu-check`) on a CPU: a skipped GPU test counts as not passed,
except one that needs more GPUs than the machine has; no GPU is an exit status of its own;
the stages' time limits fit one device call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "bench"))  # last: bench/ scripts must not shadow installed packages
import gpu_check  # noqa: E402

SUITE = '''
import pytest
def test_passes(): pass
@pytest.mark.skipif(True, reason="needs 2 CUDA GPUs (found 1)")
def test_two_gpus(): pass
def test_skips_itself(): pytest.skip("fla is not installed")
def test_fails(): assert False
class TestGroup:
    def test_import(self): pytest.importorskip("no_such_module_here")
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    """pytest's own JUnit report of a suite with every outcome, as gpu_check runs it."""
    folder = tmp_path_factory.mktemp("suite")
    (folder / "test_suite.py").write_text(SUITE)
    (folder / "test_broken.py").write_text("import no_such_module_here\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                    f"--junitxml={folder / 'r.xml'}", str(folder)], cwd=folder, capture_output=True)
    return (folder / "r.xml").read_text()


def test_skips_are_not_passes_and_more_gpus_are_apart(report):
    got = gpu_check.read_junit(report, gpus=1)
    assert got["passed"] == 1
    assert sorted(got["failed"]) == ["test_broken", "test_suite::test_fails"]  # a collection error is a failure
    assert got["skipped"] == [("test_suite::test_skips_itself", "fla is not installed"),
                              ("test_suite.TestGroup::test_import",
                               "could not import 'no_such_module_here': No module named 'no_such_module_here'")]
    assert got["need_gpus"] == [("test_suite::test_two_gpus", 2)]


def test_a_test_that_needs_the_gpus_present_and_skips_is_not_passed(report):
    got = gpu_check.read_junit(report, gpus=2)
    assert got["need_gpus"] == [] and ("test_suite::test_two_gpus", "needs 2 CUDA GPUs (found 1)") in got["skipped"]


def test_the_table_says_skipped_tests_did_not_pass(report):
    rows = gpu_check.rows_of_tests(gpu_check.read_junit(report, gpus=1), 12.0, "exit status 1")
    assert rows[0]["figure"] == "1 passed, 2 failed, 2 skipped (not passed), 1 need more GPUs, in 12 s"
    assert {(r["what"], r["figure"]) for r in rows[1:]} == {
        ("test_suite::test_fails", "failed"), ("test_broken", "failed"),
        ("test_suite::test_skips_itself", "skipped"), ("test_suite.TestGroup::test_import", "skipped"),
        ("test_suite::test_two_gpus", "needs 2 GPUs")}
    assert gpu_check.rows_of_tests(None, 240.0, "stopped at the 240 s limit")[0]["figure"] == "no report in 240 s"
    skipped, more = gpu_check.verdict(gpu_check.read_junit(report, gpus=1))
    assert skipped == ("gpu-check: 2 GPU tests skipped, not passed: test_suite::test_skips_itself, "
                       "test_suite.TestGroup::test_import")
    assert more == "gpu-check: 1 GPU tests need more GPUs (not failed): test_suite::test_two_gpus (needs 2 GPUs)"


def test_without_a_gpu_it_says_so_in_one_line_and_exits_non_zero():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even where there is one
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == gpu_check.EXIT_NO_GPU == 3, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU here" in lines[0] and "nothing checked" in lines[0], done.stdout


def test_the_stage_limits_fit_one_device_call():
    assert gpu_check.limits_fit() and gpu_check.BUDGET_S < 9 * 60
    assert not gpu_check.limits_fit(600)  # a 10-minute call would leave nothing for the machine's start
    assert not gpu_check.limits_fit(300)  # the tests alone would take the bench's time


def test_its_pytest_command_runs_and_every_skip_counts(tmp_path):
    # The very command it runs on tests/gpu; here (no GPU) each test skips: none has passed.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    rows, short, lines = gpu_check.run_tests(env, tmp_path, gpus=0)
    assert short and (tmp_path / "pytest.xml").exists()
    assert rows[0]["figure"].startswith("0 passed, 0 failed, ") and len(rows) > 40
    assert lines and lines[0].startswith("gpu-check: ") and "skipped, not passed: tests.gpu." in lines[0]
