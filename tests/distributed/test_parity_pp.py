"""Pipeline-parallel layouts reproduce the single-process losses and validation losses (CPU,
Gloo, fp32), their checkpoints resume under other layouts and the other way round, and a
tied model trains, checkpoints and exports as one model.

The reference is the debug Llama, which ties its output projection to the embedding
(`pp_reference_run`; see PP_COMMON): under a pipeline the first and last stages each hold
a copy. The measured differences are printed (pytest -s) and recorded in docs/parallelism.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from forja.cli import main
from forja.versions import torch_version
from tests.distributed.parity import (
    MOE_TOL,
    PARITY_STEPS,
    PP_COMMON,
    PP_TOL,
    RESUME_STEP,
    UNTIED,
    SharedLayouts,
    last_checkpoint,
    max_difference,
    resume_halfway,
    single_process_losses,
)
from tests.integration.conftest import losses, read_metrics

PP2 = {**PP_COMMON, "parallel.pp": "2"}
# Before 2.12, V schedules start with a send from a rank to itself, which Gloo cannot do.
OLD_TORCH_V = pytest.mark.skipif(torch_version() < (2, 12), reason="V schedules on Gloo need torch >= 2.12")


def _schedule(name: str) -> dict[str, str]:
    return {"parallel.pp_schedule": f'"{name}"'}


SCHEDULES = ["1f1b", "gpipe", "interleaved-1f1b"] + ([] if torch_version() < (2, 12) else ["zero-bubble", "dualpipev"])
FUSED = {"model.fused_ops_overrides": "{cross_entropy=true}"}
# DeepSeek-V4: stages hand on its hc_mult residual streams, and hash-routed blocks (n_hash_layers
# = 3 of its 4) sit on stages past the first, which read the token ids the pipeline hands them;
# packed documents with their masks, each compressed alone (DocumentWindows).
V4 = {"model.family": '"deepseek_v4"', "model.flavor": '"debug"', "model.document_mask": "true",
      "model.overrides": "{n_hash_layers=3}"}
# The pipeline layouts train one after another in a shared process group per rank count
# (one start-up each rather than one torchrun each); a test that resumes one copies it.
LAYOUTS = {
    **{f"PP 2 ({s})": (2, {**PP2, **_schedule(s)}) for s in SCHEDULES},
    "PP 2 untied": (2, {**PP2, **UNTIED}),
    "PP 2 fused loss": (2, {**PP2, **FUSED}),
    "PP 2 x TP 2": (4, {**PP2, "parallel.tp": "2"}),
    "PP 2 x FSDP 2": (4, PP2),
    "DeepSeek-V4 PP 2 (interleaved-1f1b)": (2, {**PP2, **_schedule("interleaved-1f1b"), **V4}),
    "DeepSeek-V4 PP 2 x TP 2": (4, {**PP2, **V4, "parallel.tp": "2"}),
}
# The first test of a shared group trains the whole group (under a minute a layout on a busy CPU).
GROUP_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    return SharedLayouts(tmp_path_factory, train_data, LAYOUTS)


def _val_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run) if "val_loss" in r}


def _check(name: str, reference: Path, run: Path, *, validation: bool = True, tol: float = PP_TOL) -> float:
    """Training losses within `tol` of the reference's, and validation losses too when
    `validation` (only without data parallelism: train.val_batches counts per dp rank, so
    dp ranks together validate on more batches than one process). Returns the training losses' max difference."""
    diff = max_difference(losses(reference), losses(run))
    message = f"parity {name}: max |loss diff| = {diff:.2e}"
    if validation:
        ref_val, val = _val_losses(reference), _val_losses(run)
        assert sorted(val) == sorted(ref_val) == [RESUME_STEP, PARITY_STEPS]
        val_diff = max(abs(ref_val[s] - val[s]) for s in ref_val)
        message += f", max |val loss diff| = {val_diff:.2e}"
        assert val_diff <= tol, message
    print(message)
    assert diff <= tol, message
    return diff


def _stored_weights(checkpoint: Path) -> set[str]:
    keys = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in keys if k.startswith("model.")}


@GROUP_TIMEOUT
@pytest.mark.parametrize("schedule", [
    "1f1b", "gpipe", "interleaved-1f1b",
    pytest.param("zero-bubble", marks=OLD_TORCH_V), pytest.param("dualpipev", marks=OLD_TORCH_V),
])
def test_pp2_schedule_matches_single_process(schedule, tmp_path, pp_reference_run, shared_runs, card):
    # 8 sequences in micro-batches of 2: 4 microbatches over 2 (or 4, two per rank) stages.
    # 1f1b, gpipe, interleaved: the tied copies live on two ranks; V schedules: both on rank 0.
    run = shared_runs.run(f"PP 2 ({schedule})", tmp_path / "run")
    diff = _check(f"PP 2 ({schedule}), tied", pp_reference_run, run)
    stored = _stored_weights(last_checkpoint(run))
    assert "tok_embeddings.weight" in stored and "output.weight" not in stored  # one tensor, as one process
    assert stored == _stored_weights(last_checkpoint(pp_reference_run))
    card("llama", "pp", diff)


@GROUP_TIMEOUT
def test_pp2_untied_matches_single_process(tmp_path, train_data, shared_runs):
    reference = tmp_path / "reference"
    single_process_losses(reference, train_data, **PP_COMMON, **UNTIED)
    run = shared_runs.run("PP 2 untied", tmp_path / "run")
    _check("PP 2 (1f1b), untied", reference, run)
    assert "output.weight" in _stored_weights(last_checkpoint(run))


@GROUP_TIMEOUT
def test_pp2_computes_the_fused_loss_on_the_last_stage(tmp_path, train_data, shared_runs):
    reference = tmp_path / "reference"
    single_process_losses(reference, train_data, **PP_COMMON, **FUSED)
    _check("PP 2 (1f1b) + fused cross-entropy", reference, shared_runs.run("PP 2 fused loss", tmp_path / "run"))


@pytest.fixture(scope="module")
def v4_reference_run(tmp_path_factory, train_data):
    run = tmp_path_factory.mktemp("ref-v4") / "run"
    single_process_losses(run, train_data, **PP_COMMON, **V4)
    return run


@GROUP_TIMEOUT
@pytest.mark.parametrize("name", ["DeepSeek-V4 PP 2 (interleaved-1f1b)", "DeepSeek-V4 PP 2 x TP 2"])
def test_deepseek_v4_pipelines_match_single_process(name, tmp_path, v4_reference_run, shared_runs):
    # interleaved: four stages of one block each, two per rank, the streams crossing between ranks
    # three times; x TP 2: a later stage receives its (B, T / tp, hc_mult x dim) slice of them (SP).
    _check(name, v4_reference_run, shared_runs.run(name, tmp_path / "run"), tol=MOE_TOL)


@GROUP_TIMEOUT
def test_pp2_x_tp2_matches_single_process(tmp_path, pp_reference_run, shared_runs):
    # Sequence parallelism (the default) hands later stages a (B, T/tp, dim) slice, and the
    # tied copies are split over the vocabulary on both ends.
    _check("PP 2 x TP 2 (1f1b, SP), tied", pp_reference_run, shared_runs.run("PP 2 x TP 2", tmp_path / "run"))


@GROUP_TIMEOUT
def test_pp2_x_fsdp2_matches_resumes_under_fsdp4_and_exports_tied(tmp_path, train_data, pp_reference_run,
                                                                   shared_runs):
    run = tmp_path / "run"  # pp 2 x dp_shard 2, 1f1b; a copy, since it resumes
    shutil.copytree(shared_runs.run("PP 2 x FSDP 2", tmp_path / "alone"), run)
    _check("PP 2 x FSDP 2 (1f1b), tied", pp_reference_run, run, validation=False)
    resume_halfway(run, train_data, 4, **PP_COMMON)
    _check(f"PP 2 x FSDP 2 -> FSDP 4 from step {RESUME_STEP}", pp_reference_run, run, validation=False)
    _export_is_tied(run, tmp_path / "hf")


def _export_is_tied(run: Path, out: Path) -> None:
    """The run exports as a tied Hugging Face model: one embedding matrix, no lm_head."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from forja.checkpoint.export import load_checkpoint_model

    assert main(["export", str(run), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, _ = load_checkpoint_model(run)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() < 1e-6  # measured 0.0


@OLD_TORCH_V
def test_single_process_checkpoint_resumes_under_pp2_zero_bubble(tmp_path, train_data, pp_reference_run):
    # Two stages per rank: each part takes its own blocks, and the last its copy of the
    # tied embedding, out of the whole model's checkpoint.
    run = tmp_path / "run"
    shutil.copytree(pp_reference_run, run)
    resume_halfway(run, train_data, 2, **PP2, **_schedule("zero-bubble"))
    _check(f"1 process -> PP 2 (zero-bubble) from step {RESUME_STEP}, tied", pp_reference_run, run)
