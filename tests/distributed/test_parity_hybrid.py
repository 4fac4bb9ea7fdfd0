"""The 2026 architectures reproduce the single-process losses under parallel layouts (CPU,
Gloo, fp32): Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) under FSDP, TP + SP, EP and PP;
gpt-oss (sinks, sliding windows, MoE with biases) under TP; Gemma 3 (local/global layers)
under FSDP x TP; DeepSeek-V3 with multi-token prediction under PP. And a hybrid run killed with SIGKILL resumes bit for
bit. Each layout's
measured difference is printed (pytest -s) and recorded in docs/models.md.
"""

from __future__ import annotations

import pytest

from forja.cli import main
from forja.files import read_records
from tests.distributed.parity import MOE_TOL, SharedLayouts, max_difference, single_process_losses
from tests.integration.conftest import kill_then_resume, losses, train_args

MODELS = {
    "qwen3_5": {"model.family": '"qwen3_5"', "model.flavor": '"debug"'},
    "qwen3_5-moe": {"model.family": '"qwen3_5"', "model.flavor": '"debug-moe"'},
    "gpt_oss": {"model.family": '"gpt_oss"', "model.flavor": '"debug"'},
    "gemma3": {"model.family": '"gemma3"', "model.flavor": '"debug"'},
    "olmo_hybrid": {"model.family": '"olmo_hybrid"', "model.flavor": '"debug"'},
    "deepseek_v3-mtp": {"model.family": '"deepseek_v3"', "model.flavor": '"debug"', "model.mtp.depth": "1"},
}
# name -> (the model, ranks, the layout's keys)
LAYOUTS = {
    "Qwen3.5 FSDP 2": ("qwen3_5", 2, {"parallel.dp_shard": "2"}),
    "Qwen3.5 TP 2 + SP": ("qwen3_5", 2, {"parallel.tp": "2", "parallel.dp_shard": "1"}),
    "Qwen3.5 PP 2": ("qwen3_5", 2, {"parallel.pp": "2", "parallel.dp_shard": "1"}),
    "Qwen3.5-MoE EP 2 x FSDP 2": ("qwen3_5-moe", 4, {"parallel.ep": "2", "parallel.dp_shard": "4"}),
    "gpt-oss TP 2": ("gpt_oss", 2, {"parallel.tp": "2", "parallel.dp_shard": "1"}),
    "Gemma 3 FSDP 2 x TP 2": ("gemma3", 4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    # Gated DeltaNet blocks on one stage, OLMo 3's post-norm attention block on the other.
    "OLMo-Hybrid PP 2": ("olmo_hybrid", 2, {"parallel.pp": "2", "parallel.dp_shard": "1"}),
    # The MTP module on the last stage, with its copy of the embedding (the ids from the labels).
    "DeepSeek-V3 + MTP PP 2": ("deepseek_v3-mtp", 2, {"parallel.pp": "2", "parallel.dp_shard": "1"}),
}


# The verification cards' cells these layouts fill: name -> (family, column) (tests/cards.py).
CARDS = {"Qwen3.5 FSDP 2": ("qwen3_5", "fsdp"), "Qwen3.5 PP 2": ("qwen3_5", "pp"),
         "Qwen3.5-MoE EP 2 x FSDP 2": ("qwen3_5", "ep"), "Gemma 3 FSDP 2 x TP 2": ("gemma3", "fsdp"),
         "OLMo-Hybrid PP 2": ("olmo_hybrid", "pp"), "DeepSeek-V3 + MTP PP 2": ("deepseek_v3", "pp")}


@pytest.fixture(scope="module")
def references(tmp_path_factory, train_data):
    """model -> its single-process losses, each trained once when first asked for."""
    cache: dict[str, dict[int, float]] = {}

    def get(model: str) -> dict[int, float]:
        if model not in cache:
            cache[model] = single_process_losses(tmp_path_factory.mktemp(f"ref-{model}") / "run", train_data,
                                                 **MODELS[model])
        return cache[model]

    return get


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    layouts = {name: (nproc, {**MODELS[model], **changes}) for name, (model, nproc, changes) in LAYOUTS.items()}
    return SharedLayouts(tmp_path_factory, train_data, layouts)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path, references, shared_runs, card):
    model = LAYOUTS[name][0]
    run = shared_runs.run(name, tmp_path / "run")
    diff = max_difference(references(model), losses(run))
    print(f"parity {name}: max |loss diff| = {diff:.2e}")
    if name in CARDS:
        card(*CARDS[name], diff)
    assert diff < MOE_TOL
    if "mtp.depth" in str(MODELS[model]):  # the depth's loss reaches rank 0's log from the last stage
        assert all(r.get("mtp/loss_1", 0) > 0 for r in read_records(run / "metrics.jsonl") if "loss" in r)


@pytest.mark.slow
def test_a_hybrid_run_killed_with_sigkill_resumes_bit_for_bit(tmp_path, train_data, card):
    steps = {"train.steps": "16", "checkpoint.interval": "4", **MODELS["qwen3_5"]}
    reference = tmp_path / "uninterrupted"
    assert main(train_args(reference, train_data, **steps)) == 0
    run = tmp_path / "killed"
    kill_then_resume(run, train_args(run, train_data, **steps), kill_at=4, last=16)
    assert losses(run) == losses(reference)  # every step, bit for bit
    card("qwen3_5", "resume", "kill -9")
