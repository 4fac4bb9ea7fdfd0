"""The SLURM templates under scripts/ parse as bash and use only flags forja's parsers know, so
that a renamed flag breaks this test rather than a cluster job hours into its queue."""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from forja.cli import build_parser

SCRIPTS = Path(__file__).parents[2] / "scripts"


def logical_lines(text: str) -> list[str]:
    """The script's commands, backslash continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(" #")[0] for line in joined.splitlines() if not line.lstrip().startswith("#")]


def flags_after(line: str, marker: str) -> set[str]:
    """The --flags of the command that follows `marker` on `line`."""
    return {tok.split("=")[0] for tok in line.split(marker, 1)[1].split() if tok.startswith("--")}


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def train_flags() -> set[str]:
    subs = next(a for a in build_parser(only="train")._actions if isinstance(a, argparse._SubParsersAction))
    return parser_flags(subs.choices["train"])


def lighthouse_flags(capsys) -> set[str]:
    from forja.train.ft.lighthouse import main

    with pytest.raises(SystemExit):
        main(["--help"])
    return set(re.findall(r"--[a-z][a-z-]+", capsys.readouterr().out))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name", ["slurm.sbatch", "prepare.sbatch", "ft_groups.sbatch"])
def test_sbatch_templates_parse(name):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", ["slurm.sbatch", "ft_groups.sbatch"])
def test_forja_train_flags_exist(name):
    lines = [ln for ln in logical_lines((SCRIPTS / name).read_text()) if "-m forja train" in ln]
    assert lines, f"{name} runs no `python -m forja train`"
    used = set().union(*(flags_after(ln, "-m forja train") for ln in lines))
    assert used and not used - train_flags(), f"{name} uses flags forja train does not know"


def test_ft_groups_uses_the_groups_flags_and_a_known_lighthouse(capsys):
    lines = logical_lines((SCRIPTS / "ft_groups.sbatch").read_text())
    train = set().union(*(flags_after(ln, "-m forja train") for ln in lines if "-m forja train" in ln))
    # what makes each step one group of several, meeting at one lighthouse, restarted alone
    assert {"--ft-groups", "--ft-group", "--ft-lighthouse", "--nproc", "--max-restarts"} <= train
    lighthouse = [ln for ln in lines if "-m forja.train.ft.lighthouse" in ln]
    assert len(lighthouse) == 1
    used = flags_after(lighthouse[0], "-m forja.train.ft.lighthouse")
    assert used and not used - lighthouse_flags(capsys)


def test_ft_groups_allocation_is_groups_times_nodes():
    text = (SCRIPTS / "ft_groups.sbatch").read_text()
    value = lambda pattern: int(re.search(pattern, text, re.M).group(1))  # noqa: E731
    nodes = value(r"^#SBATCH --nodes=(\d+)")
    assert nodes == value(r"^FT_GROUPS=(\d+)") * value(r"^NODES_PER_GROUP=(\d+)")
    assert value(r"^#SBATCH --gpus-per-node=(\d+)") == value(r"^GPUS_PER_NODE=(\d+)")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_ft_groups_runs_a_lighthouse_then_one_step_per_group_and_stops_them_in_order(tmp_path):
    """The script under stand-in srun and scontrol: the lighthouse first, on the first node, then
    each group on its own nodes with its own rendezvous; on SIGTERM the groups stop first, the
    lighthouse after them."""
    log = tmp_path / "calls"
    (tmp_path / "scontrol").write_text("#!/bin/bash\nprintf 'n%s\\n' 1 2 3 4\n")
    (tmp_path / "srun").write_text(
        "#!/bin/bash\necho \"$*\" >> \"$LOG\"\n"
        "if [[ $* == *forja.train.ft.lighthouse* ]]; then name=lighthouse; echo http://n1:29510; else name=group; fi\n"
        "trap 'echo \"$name stopped\" >> \"$LOG\"; exit 0' TERM\n"
        "while true; do sleep 0.05; done\n")
    for stub in ("scontrol", "srun"):
        (tmp_path / stub).chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "LOG": str(log), "SLURM_NNODES": "4", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NAME": "ft", "SLURM_CPUS_PER_TASK": "64"}
    text = (SCRIPTS / "ft_groups.sbatch").read_text().replace("/shared/runs", str(tmp_path / "runs"))
    proc = subprocess.Popen(["bash", "-c", text], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (log.is_file() and log.read_text().count("forja train") == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the script reaches its wait
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    calls = log.read_text().splitlines()
    assert "--nodelist=n1" in calls[0] and "forja.train.ft.lighthouse" in calls[0]
    assert calls[-3:] == ["group stopped", "group stopped", "lighthouse stopped"]
    groups = sorted((c for c in calls if "forja train" in c), key=lambda c: "--ft-group 1" in c)
    assert len(groups) == 2
    for g, (call, head) in enumerate(zip(groups, ("n1", "n3"))):
        assert f"--ft-group {g} " in call and f"--relative={2 * g}" in call
        assert f"--rdzv-endpoint {head}:29500" in call and "--ft-lighthouse n1:29510" in call
