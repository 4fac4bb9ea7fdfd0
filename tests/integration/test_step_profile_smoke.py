"""bench/step_profile.py at the debug size: both steps run, are timed in turn and profiled, and
the fusion check runs. No timing is asserted: bench/RESULTS.md has the measured figures."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import step_profile  # noqa: E402


def test_the_step_profile_times_and_profiles_both_steps(capsys):
    step_profile.main(["--flavor", "debug", "--batch", "2", "--seq-len", "16", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "forja: " in out and "HF loop: " in out and "aten::mm" in out
    assert out.count("3 steps:") == 2 and "q/k/v and w1/w3: separate" in out
