"""Each data/tensor-parallel layout reproduces the single-process losses (CPU, Gloo, fp32).

PP layouts are in test_parity_pp.py. The measured differences are in docs/parallelism.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.parity import (
    COMPILE_TOL,
    PARITY_TOL,
    RESUME_STEP,
    SAVE_HALFWAY,
    SharedLayouts,
    layout_losses,
    max_difference,
    single_process_losses,
    stop_halfway,
)
from tests.integration.conftest import losses

FSDP2 = {"parallel.dp_shard": "2"}
LAYOUTS = {
    "DDP 2": (2, {"parallel.dp_replicate": "2", "parallel.dp_shard": "1"}),
    "FSDP 2 (ZeRO-3)": (2, FSDP2),
    "FSDP 2 (ZeRO-2)": (2, {**FSDP2, "parallel.reshard_after_forward": "false"}),
    # Megatron's distributed optimizer: two micro-batches a rank, reduced once after the second.
    "FSDP 2 (ZeRO-2), gradients reduced once a step": (2, {**FSDP2, "parallel.reshard_after_forward": "false",
                                                            "parallel.grad_sync": '"step"'}),
    "HSDP 2x2": (4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}),
    "TP 2": (2, {"parallel.tp": "2", "parallel.dp_shard": "1", "parallel.sequence_parallel": "false"}),
    "TP 2 + SP": (2, {"parallel.tp": "2", "parallel.dp_shard": "1"}),
    "FSDP 2 x TP 2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    "FSDP 2 + full AC": (2, {**FSDP2, "parallel.ac": '"full"'}),
    "FSDP 2 + selective AC (op-level)": (2, {**FSDP2, "parallel.ac": '"selective"'}),
    "FSDP 2 + selective AC (every 2nd block)": (2, {**FSDP2, "parallel.ac": '"selective"', "parallel.ac_every": "2"}),
    # Inductor's code generation is exercised once a rank count (its first compile costs 10-30 s of
    # C++ builds on this CPU); the other compiled layouts trace the same graphs through AOTAutograd
    # (where TP's compile bug lived, docs/parallelism.md) and run them op by op.
    "FSDP 2 + compile (aot_eager)": (2, {**FSDP2, "parallel.compile": "true",
                                         "parallel.compile_backend": '"aot_eager"'}),
    # FSDP's CPU offload on a CPU-only machine runs unpinned: the same code path as on GPUs.
    "FSDP 2 + CPU offload": (2, {**FSDP2, "parallel.cpu_offload": "true"}),
    # The pieces compose.
    "FSDP 2 x TP 2 + SP + selective AC": (4, {"parallel.tp": "2", "parallel.dp_shard": "2",
                                             "parallel.ac": '"selective"'}),
    "FSDP 2 + full AC + compile": (2, {**FSDP2, "parallel.ac": '"full"', "parallel.compile": "true"}),
    # Compiled TP blocks: torch 2.13/2.14 need the embedding's output waited for (forja/parallel/tp.py).
    "FSDP 2 x TP 2 + SP + compile (aot_eager)": (4, {"parallel.tp": "2", "parallel.dp_shard": "2",
                                                     "parallel.compile": "true",
                                                     "parallel.compile_backend": '"aot_eager"'}),
    # Fused ops (their PyTorch references on CPU) with the vocabulary-parallel fused loss.
    "TP 2 + SP + fused ops": (2, {"parallel.tp": "2", "parallel.dp_shard": "1", "model.fused_ops": "true"}),
}


BF16 = {**FSDP2, "parallel.mixed_precision": '"bf16"'}
# The layouts train one after another in a few shared process groups (one start-up each
# rather than one torchrun each): one a rank count, compiled ones last. FSDP 2 (ZeRO-3) saves
# halfway as it trains for parity (a checkpoint changes no loss): the run the resharding
# tests resume from (each a copy), rather than a second run of the same layout.
RESHARD_SOURCE = "FSDP 2 (ZeRO-3)"
# Padding (data.packing = "best-fit", pieces of at most 40 tokens in samples of 65): each rank's
# micro-batches weigh by their labels, so the loss is still one process's.
BEST_FIT = {"data.packing": '"best-fit"', "data.max_doc_tokens": "40"}
SHARED = {**LAYOUTS, RESHARD_SOURCE: (2, {**FSDP2, **SAVE_HALFWAY}), "FSDP 2 + bf16": (2, BF16),
          "FSDP 2, best-fit packing": (2, {**FSDP2, **BEST_FIT})}


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    return SharedLayouts(tmp_path_factory, train_data, SHARED)


def _losses_of(name: str, shared_runs, run: Path) -> dict[int, float]:
    """The layout's losses from its shared group (or, if it failed there, trained alone)."""
    return losses(shared_runs.run(name, run))


# The first test of a shared group trains the whole group (under a minute a layout on a busy CPU).
GROUP_TIMEOUT = pytest.mark.timeout(600)


@GROUP_TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path, train_data, reference_losses, shared_runs, card):
    changes = LAYOUTS[name][1]
    diff = max_difference(reference_losses, _losses_of(name, shared_runs, tmp_path / "run"))
    print(f"parity {name}: max |loss diff| = {diff:.2e}")
    if name in ("FSDP 2 (ZeRO-3)", "TP 2 + SP"):  # the cards' cells (tests/cards.py)
        card("llama", "fsdp" if name.startswith("FSDP") else "tp_sp", diff)
    assert diff < (COMPILE_TOL if changes.get("parallel.compile") == "true" else PARITY_TOL)


@GROUP_TIMEOUT
def test_best_fit_padding_matches_single_process(tmp_path, train_data, shared_runs):
    reference = single_process_losses(tmp_path / "one", train_data, **BEST_FIT)
    diff = max_difference(reference, _losses_of("FSDP 2, best-fit packing", shared_runs, tmp_path / "run"))
    print(f"parity FSDP 2, best-fit packing: max |loss diff| = {diff:.2e}")
    assert diff < PARITY_TOL


BF16_TOL = 2e-2  # bf16 parameters and activations (fp32 reduction): ~3 significant digits


@GROUP_TIMEOUT
def test_bf16_mixed_precision_within_a_looser_bound(tmp_path, train_data, reference_losses, shared_runs):
    run = _losses_of("FSDP 2 + bf16", shared_runs, tmp_path / "run")
    diff = max_difference(reference_losses, run)
    print(f"parity FSDP 2 + bf16 mixed precision: max |loss diff| = {diff:.2e}")
    assert diff < BF16_TOL


def _stopped_halfway_under(tmp_path, shared_runs):
    """A copy of the FSDP 2 run, as if it had stopped halfway."""
    run = tmp_path / "run"
    shutil.copytree(shared_runs.run(RESHARD_SOURCE, tmp_path / "alone"), run)  # each test its own
    stop_halfway(run)
    return run


@GROUP_TIMEOUT
@pytest.mark.parametrize(("target", "nproc"), [("TP 2 x FSDP 2", 4), ("1 process", 1)])
def test_fsdp_checkpoint_resumes_under_another_layout(tmp_path, train_data, reference_losses, target, nproc,
                                                      shared_runs):
    run = _stopped_halfway_under(tmp_path, shared_runs)
    changes = {"parallel.tp": "2", "parallel.dp_shard": "2"} if nproc == 4 else {}
    if nproc == 1:
        from forja.cli import main
        from tests.distributed.parity import COMMON
        from tests.integration.conftest import train_args

        assert main(train_args(run, train_data, **{**COMMON, **SAVE_HALFWAY})) == 0
    else:
        layout_losses(run, train_data, nproc, **{**changes, **SAVE_HALFWAY})
    diff = max_difference(reference_losses, losses(run))
    print(f"resharding FSDP 2 -> {target} after step {RESUME_STEP}: max |loss diff| = {diff:.2e}")
    assert diff < PARITY_TOL
