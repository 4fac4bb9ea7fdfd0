"""Mixture-of-experts layouts reproduce the single-process losses (CPU, Gloo, fp32).

The model is qwen3 `debug-moe` (8 experts, top 2, one dense block) with a load-balancing
loss and a z-loss, so the auxiliary losses' gradients are part of what must match. Each
layout's measured difference is printed (pytest -s) and recorded in docs/parallelism.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.parity import MOE_TOL, layout_losses, max_difference, single_process_losses
from tests.integration.conftest import forja_process, losses, train_args

MOE = {"model.family": '"qwen3"', "model.flavor": '"debug-moe"',
       "model.overrides": "{aux_loss_weight=0.01, z_loss_weight=0.001}"}
EP2 = {**MOE, "parallel.ep": "2", "parallel.dp_shard": "2"}
# DeepSeek-V3's routing: sigmoid scores, expert groups, a shared expert, and the
# auxiliary-loss-free bias moving every step (its update sums the counts over the ranks).
DEEPSEEK = {"model.family": '"deepseek_v3"', "model.flavor": '"debug"',
            "model.overrides": "{bias_update_rate=0.001}"}
LAYOUTS = {
    "EP 2": (2, EP2),
    "EP 2, DeepSeek-V3 routing and bias update": (2, {**DEEPSEEK, "parallel.ep": "2", "parallel.dp_shard": "2"}),
    "EP 2 x TP 2 + SP, DeepSeek-V3 (latent attention)": (4, {**DEEPSEEK, "parallel.ep": "2", "parallel.dp_shard": "2",
                                                             "parallel.tp": "2"}),
    "EP 2 + full AC": (2, {**EP2, "parallel.ac": '"full"'}),
    "HSDP 2 x EP 2": (4, {**EP2, "parallel.dp_replicate": "2"}),
    "EP 2 + compile": (2, {**EP2, "parallel.compile": "true"}),
    "EP 2 x FSDP 2": (4, {**MOE, "parallel.ep": "2", "parallel.dp_shard": "4"}),
    "EP 2 x TP 2 + SP": (4, {**EP2, "parallel.tp": "2"}),
    "PP 2 x EP 2": (4, {**EP2, "parallel.pp": "2"}),
}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, train_data):
    """The single-process losses of the qwen3 MoE model."""
    return single_process_losses(tmp_path_factory.mktemp("ref-moe") / "run", train_data, **MOE)


@pytest.fixture(scope="module")
def deepseek_reference(tmp_path_factory, train_data):
    return single_process_losses(tmp_path_factory.mktemp("ref-deepseek") / "run", train_data, **DEEPSEEK)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, tmp_path, train_data, request):
    nproc, changes = LAYOUTS[name]
    reference = request.getfixturevalue("deepseek_reference" if "DeepSeek" in name else "moe_reference")
    diff = max_difference(reference, layout_losses(tmp_path / "run", train_data, nproc, **changes))
    print(f"parity {name}: max |loss diff| = {diff:.2e}")
    assert diff < MOE_TOL


def _saved_at_5(run, train_data, nproc, changes):
    """Train 10 steps under a layout, keeping the step-5 checkpoint only, as if stopped at 5."""
    layout_losses(run, train_data, nproc, **{**changes, "checkpoint.interval": "5", "checkpoint.keep": "0"})
    shutil.rmtree(run / "checkpoints" / "step-00000010")


@pytest.mark.parametrize(("source", "target"), [
    ("EP 2", "1 process"),
    ("EP 2 x FSDP 2", "EP 4"),
    # The bias of auxiliary-loss-free balancing is part of the checkpoint: resumed without it,
    # routing would differ at once.
    ("EP 2, DeepSeek-V3 routing and bias update", "1 process"),
])
def test_moe_checkpoint_reshards_between_ep_layouts(tmp_path, train_data, request, source, target):
    run = tmp_path / "run"
    _saved_at_5(run, train_data, *LAYOUTS[source])
    model = DEEPSEEK if "DeepSeek" in source else MOE
    resume = {"checkpoint.interval": "5", "checkpoint.keep": "0"}
    if target == "1 process":
        single_process_losses(run, train_data, **model, **resume)
    else:
        layout_losses(run, train_data, 4, **model, **resume, **{"parallel.ep": "4", "parallel.dp_shard": "4"})
    reference = request.getfixturevalue("deepseek_reference" if "DeepSeek" in source else "moe_reference")
    diff = max_difference(reference, losses(run))
    print(f"resharding {source} -> {target}: max |loss diff| = {diff:.2e}")
    assert diff < MOE_TOL


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def test_kill_9_of_a_rank_then_resume_is_bit_identical_under_ep(tmp_path, train_data):
    steps = {**EP2, "train.steps": "16", "checkpoint.interval": "4", "metrics.interval": "1"}
    reference = tmp_path / "uninterrupted"
    proc = forja_process(train_args(reference, train_data, **steps) + ["--nproc", "2"])
    assert proc.wait(timeout=600) == 0, proc.stdout.read()[-3000:]

    run = tmp_path / "killed"
    proc = forja_process(train_args(run, train_data, **steps) + ["--nproc", "2"])
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-00000008").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    workers = [p for p in _descendants(proc.pid) if not _descendants(p)]  # the leaves: the ranks
    os.kill(workers[-1], signal.SIGKILL)  # one rank dies with no handler run
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert not (run / "checkpoints" / "step-00000016").exists(), "the run finished before a rank was killed"

    resumed = forja_process(train_args(run, train_data, **steps) + ["--nproc", "2"])
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert "resumed from" in out
    assert losses(run) == losses(reference)  # every step, bit for bit
