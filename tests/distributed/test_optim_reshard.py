"""Lion, Adafactor and SOAP under FSDP 2 match one process, and their state saved by the 2
ranks resumes in 1 process: the steps after the checkpoint match the ones the 2 ranks took
(CPU, Gloo, fp32). Muon's own reshard test
is in test_parity_muon.py; SOAP's kill -9 drill in tests/integration/test_soap_resume.py."""

from __future__ import annotations

import shutil

import pytest

from forja.cli import main
from tests.distributed.parity import (
    COMMON,
    PARITY_STEPS,
    RESUME_STEP,
    SAVE_HALFWAY,
    SharedLayouts,
    max_difference,
    single_process_losses,
    stop_halfway,
)
from tests.integration.conftest import losses, train_args

TOL = 1e-5
# SOAP's first eigenbases come from a rank-deficient factor (G G^T of one step): in its null
# space any basis is an eigenbasis, and the last-bit differences of gradients summed by FSDP
# choose another one than one process does, so the layouts agree exactly until the first
# rotated step (step 2) and then drift apart by a few 1e-3 in loss. Both are SOAP.
SOAP_DRIFT = 2e-2
OPTIMIZERS = {
    "lion": {"optim.name": '"lion"', "optim.lr": "3e-4"},
    "adafactor": {"optim.name": '"adafactor"', "optim.lr": "1e-2"},
    "soap": {"optim.name": '"soap"', "optim.lr": "3e-3", "optim.soap.precondition_frequency": "3"},
}


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    """The three FSDP 2 runs, trained one after another in one process group of 2."""
    layouts = {name: (2, {**optim, **SAVE_HALFWAY, "parallel.dp_shard": "2"}) for name, optim in OPTIMIZERS.items()}
    return SharedLayouts(tmp_path_factory, train_data, layouts)


@pytest.mark.timeout(600)  # the first test trains the shared group
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fsdp_matches_one_process_and_its_state_resumes_there(name, tmp_path, train_data, shared_runs):
    run = tmp_path / "run"  # a copy: it resumes
    optim = OPTIMIZERS[name]
    shutil.copytree(shared_runs.run(name, tmp_path / "alone"), run)
    fsdp = losses(run)
    one = single_process_losses(tmp_path / "one", train_data, **optim)
    parity = max_difference(one, fsdp)
    print(f"{name}: FSDP 2 vs 1 process: max |loss diff| = {parity:.2e}")
    if name == "soap":
        assert max(abs(one[s] - fsdp[s]) for s in (1, 2)) < TOL and parity < SOAP_DRIFT
    else:
        assert parity < TOL
    stop_halfway(run)  # as if the 2 ranks had stopped there
    assert main(train_args(run, train_data, **{**COMMON, **optim, **SAVE_HALFWAY})) == 0
    resumed = {step: loss for step, loss in losses(run).items() if step > RESUME_STEP}
    assert sorted(resumed) == list(range(RESUME_STEP + 1, PARITY_STEPS + 1))
    diff = max(abs(fsdp[s] - resumed[s]) for s in resumed)
    print(f"{name}: FSDP 2 -> 1 process after step {RESUME_STEP}: max |loss diff| = {diff:.2e}")
    assert diff < TOL
