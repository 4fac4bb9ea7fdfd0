"""forja's context parallelism reproduces the single-process losses (CPU, Gloo, fp32,
PARITY_STEPS steps): both kinds at cp 2 and 4, document masks, with FSDP, TP + SP, PP and EP, sliding windows
and sinks (gpt-oss), a Gated DeltaNet hybrid (Qwen3.5) and latent attention (DeepSeek-V3);
and checkpoints move between CP and non-CP layouts. Each layout's measured difference is
printed (pytest -s) and recorded in docs/parallelism.md."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from forja.cli import main
from tests.distributed.parity import (
    COMMON,
    MOE_TOL,
    PARITY_TOL,
    RESUME_STEP,
    SAVE_HALFWAY,
    SharedLayouts,
    max_difference,
    resume_halfway,
)
from tests.integration.conftest import losses, train_args

MODELS = {
    "llama causal": {"model.document_mask": "false"},
    "llama": {},  # document masks on, as by default
    "gpt_oss": {"model.family": '"gpt_oss"'},
    "qwen3_5": {"model.family": '"qwen3_5"'},
    "deepseek_v3": {"model.family": '"deepseek_v3"'},
}
RING, A2A = {"parallel.cp_kind": '"ring"'}, {"parallel.cp_kind": '"all-to-all"'}
# name -> (model, ranks, the layout's keys, bound)
LAYOUTS = {
    "all-to-all CP 2": ("llama causal", 2, {**A2A, "parallel.cp": "2", "parallel.dp_shard": "1"}, PARITY_TOL),
    "ring CP 2": ("llama causal", 2, {**RING, "parallel.cp": "2", "parallel.dp_shard": "1"}, PARITY_TOL),
    "ring CP 2, document masks": ("llama", 2, {**RING, "parallel.cp": "2", "parallel.dp_shard": "1"}, PARITY_TOL),
    "gpt-oss ring CP 2 (sliding windows, sinks)": ("gpt_oss", 2, {**RING, "parallel.cp": "2",
                                                                  "parallel.dp_shard": "1"}, MOE_TOL),
    "Qwen3.5 ring CP 2 (Gated DeltaNet scan)": ("qwen3_5", 2, {**RING, "parallel.cp": "2",
                                                               "parallel.dp_shard": "1"}, PARITY_TOL),
    "DeepSeek-V3 all-to-all CP 2 (latent attention)": ("deepseek_v3", 2, {**A2A, "parallel.cp": "2",
                                                                          "parallel.dp_shard": "1"}, MOE_TOL),
    "all-to-all CP 4": ("llama causal", 4, {**A2A, "parallel.cp": "4", "parallel.dp_shard": "1"}, PARITY_TOL),
    "ring CP 4": ("llama causal", 4, {**RING, "parallel.cp": "4", "parallel.dp_shard": "1"}, PARITY_TOL),
    "ring CP 2 x FSDP 2": ("llama", 4, {**RING, "parallel.cp": "2", "parallel.dp_shard": "2"}, PARITY_TOL),
    "all-to-all CP 2 x TP 2 + SP": ("llama", 4, {**A2A, "parallel.cp": "2", "parallel.tp": "2",
                                                 "parallel.dp_shard": "1"}, PARITY_TOL),
    # the experts' FSDP ranks join cp: the same experts see each cp rank's tokens
    "DeepSeek-V3 ring CP 2 x EP 2": ("deepseek_v3", 4, {**RING, "parallel.cp": "2", "parallel.ep": "2",
                                                      "parallel.dp_shard": "2"}, MOE_TOL),
    # each stage makes its micro-batch's part of the rows from the documents the schedule hands it
    "ring CP 2 x PP 2 (1f1b)": ("llama", 4, {**RING, "parallel.cp": "2", "parallel.pp": "2",
                                             "parallel.dp_shard": "1"}, PARITY_TOL),
}


# The verification cards' cells these layouts fill: name -> (family, column) (tests/cards.py).
CARDS = {"all-to-all CP 2": ("llama", "cp_all_to_all"), "ring CP 2": ("llama", "cp_ring"),
         "gpt-oss ring CP 2 (sliding windows, sinks)": ("gpt_oss", "cp_ring"),
         "Qwen3.5 ring CP 2 (Gated DeltaNet scan)": ("qwen3_5", "cp_ring"),
         "DeepSeek-V3 all-to-all CP 2 (latent attention)": ("deepseek_v3", "cp_all_to_all"),
         "DeepSeek-V3 ring CP 2 x EP 2": ("deepseek_v3", "cp_ring")}


@pytest.fixture(scope="module")
def references(tmp_path_factory, train_data):
    """model -> its single-process run (halfway checkpoint kept), trained once when first asked for."""
    cache: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in cache:
            run = tmp_path_factory.mktemp(f"ref-{model.replace(' ', '-')}") / "run"
            assert main(train_args(run, train_data, **{**COMMON, **SAVE_HALFWAY, **MODELS[model]})) == 0
            cache[model] = run
        return cache[model]

    return get


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    # Every run keeps its halfway checkpoint, for the tests that resume under another layout.
    layouts = {name: (nproc, {**SAVE_HALFWAY, **MODELS[model], **changes})
               for name, (model, nproc, changes, _) in LAYOUTS.items()}
    return SharedLayouts(tmp_path_factory, train_data, layouts)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path, references, shared_runs, card):
    model, _, _, bound = LAYOUTS[name]
    diff = max_difference(losses(references(model)), losses(shared_runs.run(name, tmp_path / "run")))
    print(f"parity {name}: max |loss diff| = {diff:.2e}")
    if name in CARDS:
        card(*CARDS[name], diff)
    assert diff < bound


@pytest.mark.slow
def test_a_cp_checkpoint_resumes_in_one_process(tmp_path, train_data, references, shared_runs):
    run = tmp_path / "run"  # a copy: it resumes
    shutil.copytree(shared_runs.run("ring CP 2, document masks", tmp_path / "alone"), run)
    resume_halfway(run, train_data, 1, **SAVE_HALFWAY)
    diff = max_difference(losses(references("llama")), losses(run))
    print(f"parity ring CP 2 -> 1 process from step {RESUME_STEP}: max |loss diff| = {diff:.2e}")
    assert diff < PARITY_TOL


@pytest.mark.slow
def test_a_single_process_checkpoint_resumes_under_cp(tmp_path, train_data, references):
    run = tmp_path / "run"
    shutil.copytree(references("llama"), run)
    resume_halfway(run, train_data, 2, **SAVE_HALFWAY, **A2A, **{"parallel.cp": "2", "parallel.dp_shard": "1"})
    diff = max_difference(losses(references("llama")), losses(run))
    print(f"parity 1 process -> all-to-all CP 2 from step {RESUME_STEP}: max |loss diff| = {diff:.2e}")
    assert diff < PARITY_TOL
