"""Muon under data, tensor and pipeline parallelism reproduces the single-process Muon losses
(CPU, Gloo, fp32), and its sharded state resumes in one process.

Muon orthogonalizes whole matrices: under FSDP and TP each matrix's update is gathered, one
rank orthogonalizes it and broadcasts it (forja/optim/muon.py). The measured differences are
printed (pytest -s).
"""

from __future__ import annotations

import shutil

import pytest

from forja.cli import main
from tests.distributed.parity import COMMON, PP_COMMON, layout_losses, max_difference, single_process_losses
from tests.integration.conftest import losses, train_args

# The brief's bound. NS amplifies the last-place differences of summed gradients a little, but
# in fp32 on CPU the layouts stay close to what AdamW measures (tests/distributed/parity.py).
MUON_TOL = 1e-5
MUON = {"optim.name": '"muon"', "optim.lr": "0.02", "optim.muon.adamw_lr": "0.003"}
SAVE_AT_5 = {"checkpoint.interval": "5", "checkpoint.keep": "0"}


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory, train_data):
    return single_process_losses(tmp_path_factory.mktemp("ref-muon") / "run", train_data, **MUON)


LAYOUTS = {
    "FSDP 2 x TP 2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    "PP 2": (2, {**PP_COMMON, "parallel.pp": "2"}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_single_process(name, tmp_path, train_data, muon_reference):
    nproc, changes = LAYOUTS[name]
    diff = max_difference(muon_reference, layout_losses(tmp_path / "run", train_data, nproc, **MUON, **changes))
    print(f"muon parity {name}: max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL


def test_muon_fsdp_matches_and_its_checkpoint_resumes_in_one_process(tmp_path, train_data, muon_reference):
    run = tmp_path / "run"
    fsdp = layout_losses(run, train_data, 2, **MUON, **SAVE_AT_5, **{"parallel.dp_shard": "2"})
    diff = max_difference(muon_reference, fsdp)
    print(f"muon parity FSDP 2: max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL
    shutil.rmtree(run / "checkpoints" / "step-00000010")  # as if the run had stopped at step 5
    assert main(train_args(run, train_data, **{**COMMON, **MUON, **SAVE_AT_5})) == 0
    diff = max_difference(muon_reference, losses(run))
    print(f"muon resharding FSDP 2 -> 1 process: max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL


MOE = {"model.family": '"qwen3"', "model.flavor": '"debug-moe"'}


def test_muon_expert_parallel_matches_single_process(tmp_path, train_data):
    # Stacked experts sharded over "ep" and FSDP ("efsdp"): gathered over efsdp only, each EP
    # rank orthogonalizes its own experts.
    reference = single_process_losses(tmp_path / "ref", train_data, **MUON, **MOE)
    run = layout_losses(tmp_path / "run", train_data, 4, **MUON, **MOE, **{"parallel.ep": "2", "parallel.dp_shard": "4"})
    diff = max_difference(reference, run)
    print(f"muon parity EP 2 x FSDP 2 (qwen3 debug-moe): max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL
