"""Each data/tensor-parallel layout reproduces the single-process losses (CPU, Gloo, fp32).

PP layouts are in test_parity_pp.py. The measured differences are in docs/parallelism.md.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.parity import COMPILE_TOL, PARITY_TOL, layout_losses, max_difference
from tests.integration.conftest import losses

FSDP2 = {"parallel.dp_shard": "2"}
LAYOUTS = {
    "DDP 2": (2, {"parallel.dp_replicate": "2", "parallel.dp_shard": "1"}),
    "FSDP 2 (ZeRO-3)": (2, FSDP2),
    "FSDP 2 (ZeRO-2)": (2, {**FSDP2, "parallel.reshard_after_forward": "false"}),
    "HSDP 2x2": (4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}),
    "TP 2": (2, {"parallel.tp": "2", "parallel.dp_shard": "1", "parallel.sequence_parallel": "false"}),
    "TP 2 + SP": (2, {"parallel.tp": "2", "parallel.dp_shard": "1"}),
    "FSDP 2 x TP 2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    "FSDP 2 + full AC": (2, {**FSDP2, "parallel.ac": '"full"'}),
    "FSDP 2 + selective AC (op-level)": (2, {**FSDP2, "parallel.ac": '"selective"'}),
    "FSDP 2 + selective AC (every 2nd block)": (2, {**FSDP2, "parallel.ac": '"selective"', "parallel.ac_every": "2"}),
    "FSDP 2 + compile": (2, {**FSDP2, "parallel.compile": "true"}),
    # FSDP's CPU offload on a CPU-only machine runs unpinned: the same code path as on GPUs.
    "FSDP 2 + CPU offload": (2, {**FSDP2, "parallel.cpu_offload": "true"}),
    # The pieces compose.
    "FSDP 2 x TP 2 + SP + selective AC": (4, {"parallel.tp": "2", "parallel.dp_shard": "2",
                                             "parallel.ac": '"selective"'}),
    "FSDP 2 + full AC + compile": (2, {**FSDP2, "parallel.ac": '"full"', "parallel.compile": "true"}),
    # Compiled TP blocks: torch 2.13/2.14 need the embedding's output waited for (forja/parallel/tp.py).
    "FSDP 2 x TP 2 + SP + compile": (4, {"parallel.tp": "2", "parallel.dp_shard": "2", "parallel.compile": "true"}),
    # Fused ops (their PyTorch references on CPU) with the vocabulary-parallel fused loss.
    "TP 2 + SP + fused ops": (2, {"parallel.tp": "2", "parallel.dp_shard": "1", "model.fused_ops": "true"}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path, train_data, reference_losses):
    nproc, changes = LAYOUTS[name]
    diff = max_difference(reference_losses, layout_losses(tmp_path / "run", train_data, nproc, **changes))
    print(f"parity {name}: max |loss diff| = {diff:.2e}")
    assert diff < (COMPILE_TOL if changes.get("parallel.compile") == "true" else PARITY_TOL)


BF16_TOL = 2e-2  # bf16 parameters and activations (fp32 reduction): ~3 significant digits


def test_bf16_mixed_precision_within_a_looser_bound(tmp_path, train_data, reference_losses):
    run = layout_losses(tmp_path / "run", train_data, 2, **{**FSDP2, "parallel.mixed_precision": '"bf16"'})
    diff = max_difference(reference_losses, run)
    print(f"parity FSDP 2 + bf16 mixed precision: max |loss diff| = {diff:.2e}")
    assert diff < BF16_TOL


def _save_at_5_under(tmp_path, train_data, nproc, changes):
    run = tmp_path / "run"
    layout_losses(run, train_data, nproc, **{**changes, "checkpoint.interval": "5", "checkpoint.keep": "0"})
    shutil.rmtree(run / "checkpoints" / "step-00000010")  # as if the run had stopped at step 5
    return run


@pytest.mark.parametrize(("target", "nproc"), [("TP 2 x FSDP 2", 4), ("1 process", 1)])
def test_fsdp_checkpoint_resumes_under_another_layout(tmp_path, train_data, reference_losses, target, nproc):
    run = _save_at_5_under(tmp_path, train_data, 2, FSDP2)
    changes = {"parallel.tp": "2", "parallel.dp_shard": "2"} if nproc == 4 else {}
    if nproc == 1:
        from forja.cli import main
        from tests.distributed.parity import COMMON
        from tests.integration.conftest import train_args

        assert main(train_args(run, train_data, **{**COMMON, "checkpoint.interval": "5", "checkpoint.keep": "0"})) == 0
    else:
        layout_losses(run, train_data, nproc, **{**changes, "checkpoint.interval": "5", "checkpoint.keep": "0"})
    diff = max_difference(reference_losses, losses(run))
    print(f"resharding FSDP 2 -> {target}: max |loss diff| = {diff:.2e}")
    assert diff < PARITY_TOL
