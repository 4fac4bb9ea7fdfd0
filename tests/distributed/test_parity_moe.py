"""Mixture-of-experts layouts reproduce the single-process losses (CPU, Gloo, fp32).

The model is qwen3 `debug-moe` (8 experts, top 2, one dense block) with a load-balancing
loss and a z-loss, so the auxiliary losses' gradients are part of what must match. Each
layout's measured difference is printed (pytest -s) and recorded in docs/parallelism.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.parity import (
    EP2,
    MOE,
    MOE_TOL,
    RESUME_STEP,
    SAVE_HALFWAY,
    SharedLayouts,
    layout_losses,
    max_difference,
    single_process_losses,
    stop_halfway,
)
from tests.integration.conftest import losses

# TP without FSDP: sharded matrices beside whole norms, stepped by the for-loop AdamW that
# forja takes itself for such a mix (forja/optim/optimizers.py, a recorded fallback).
TP2_PLAIN = {"parallel.tp": "2", "parallel.dp_shard": "1"}
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
    # Traced through AOTAutograd and run op by op: inductor's C++ build of the expert code cost 53 s
    # on this CPU, and its code generation is exercised by test_parity.py's FSDP 2 + full AC + compile.
    "EP 2 + compile (aot_eager)": (2, {**EP2, "parallel.compile": "true", "parallel.compile_backend": '"aot_eager"'}),
    "EP 2 x FSDP 2": (4, {**MOE, "parallel.ep": "2", "parallel.dp_shard": "4"}),
    "EP 2 x TP 2 + SP": (4, {**EP2, "parallel.tp": "2"}),
    # Under selective AC a pipeline recomputes each block in its backward, after the stage's forward
    # root is over: the experts' own FSDP unit must not start a root of its own (forja/parallel/ac.py).
    # (Without AC, PP 2 x EP 2 measured 4.8e-07, docs/parallelism.md.)
    "PP 2 x EP 2 + selective AC": (4, {**EP2, "parallel.pp": "2", "parallel.ac": '"selective"'}),
    # TP splits each MoE layer's tokens over its ranks and spreads the experts over them.
    "TP 2 + SP (MoE tokens split)": (2, {**MOE, "parallel.tp": "2", "parallel.dp_shard": "1"}),
    # Without FSDP, a TP model holds plain and DTensor parameters side by side in one optimizer
    # group (Qwen3's norms beside its replicated QK-norm weights; DeepSeek-V3's whole latent
    # projections beside its split ones), which torch's foreach AdamW refuses, MoE or dense:
    # these layouts step parameter by parameter.
    # (DeepSeek-V3 with SP is EP 2 x TP 2 + SP above; alone it measured 9.5e-07, docs/parallelism.md.)
    "TP 2 (MoE tokens split)": (2, {**MOE, **TP2_PLAIN, "parallel.sequence_parallel": "false"}),
    "TP 2, DeepSeek-V3 (MoE tokens split, shared expert)": (2, {**DEEPSEEK, **TP2_PLAIN,
                                                                "parallel.sequence_parallel": "false"}),
}


# The resharding tests resume these halfway: they keep their checkpoints as they train
# for parity (a checkpoint changes no loss), rather than train again.
RESHARD_SOURCES = ("EP 2", "EP 2 x FSDP 2", "EP 2, DeepSeek-V3 routing and bias update")
# The layouts train one after another in a shared process group per rank count (one start-up
# each rather than one torchrun each); the first test of a group trains the whole group.
GROUP_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    layouts = {name: (nproc, {**changes, **(SAVE_HALFWAY if name in RESHARD_SOURCES else {})})
               for name, (nproc, changes) in LAYOUTS.items()}
    return SharedLayouts(tmp_path_factory, train_data, layouts)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, train_data):
    """The single-process losses of the qwen3 MoE model."""
    return single_process_losses(tmp_path_factory.mktemp("ref-moe") / "run", train_data, **MOE)


@pytest.fixture(scope="module")
def deepseek_reference(tmp_path_factory, train_data):
    return single_process_losses(tmp_path_factory.mktemp("ref-deepseek") / "run", train_data, **DEEPSEEK)


# The verification cards' cells these layouts fill (tests/cards.py): the experts' layouts keep
# FSDP 2 over everything else.
CARDS = {"EP 2": (("qwen3", "ep"), ("qwen3", "fsdp")),
         "EP 2, DeepSeek-V3 routing and bias update": (("deepseek_v3", "ep"), ("deepseek_v3", "fsdp")),
         "PP 2 x EP 2 + selective AC": (("qwen3", "pp"),)}


@GROUP_TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, tmp_path, request, shared_runs, card):
    reference = request.getfixturevalue("deepseek_reference" if "DeepSeek" in name else "moe_reference")
    diff = max_difference(reference, losses(shared_runs.run(name, tmp_path / "run")))
    print(f"parity {name}: max |loss diff| = {diff:.2e}")
    for family, column in CARDS.get(name, ()):
        card(family, column, diff)
    assert diff < MOE_TOL


def _stopped_halfway(run: Path, source: str, shared_runs) -> None:
    """A copy of the source layout's run as if it had stopped halfway."""
    shutil.copytree(shared_runs.run(source, run.parent / "alone"), run)  # each test its own
    stop_halfway(run)


@GROUP_TIMEOUT
@pytest.mark.parametrize(("source", "target"), [
    ("EP 2", "1 process"),
    ("EP 2 x FSDP 2", "EP 4"),
    # The bias of auxiliary-loss-free balancing is part of the checkpoint: resumed without it,
    # routing would differ at once.
    ("EP 2, DeepSeek-V3 routing and bias update", "1 process"),
])
def test_moe_checkpoint_reshards_between_ep_layouts(tmp_path, train_data, request, source, target, shared_runs):
    run = tmp_path / "run"
    _stopped_halfway(run, source, shared_runs)
    model = DEEPSEEK if "DeepSeek" in source else MOE
    if target == "1 process":
        single_process_losses(run, train_data, **model, **SAVE_HALFWAY)
    else:
        layout_losses(run, train_data, 4, **model, **SAVE_HALFWAY, **{"parallel.ep": "4", "parallel.dp_shard": "4"})
    reference = request.getfixturevalue("deepseek_reference" if "DeepSeek" in source else "moe_reference")
    diff = max_difference(reference, losses(run))
    print(f"resharding {source} -> {target} after step {RESUME_STEP}: max |loss diff| = {diff:.2e}")
    assert diff < MOE_TOL


def _expert_rows(rank: int, world: int, tp: int, sp: bool):
    """One forward and backward of qwen3 debug-moe (fp32) over `world` ranks with parallel.tp
    = tp: (loss, rows entering each MoE layer's experts on this rank, router gradient)."""
    import torch

    from forja.models import model_args
    from forja.models.common.moe import moe_layers
    from forja.parallel.config import ParallelConfig
    from forja.parallel.degrees import Degrees
    from forja.parallel.dims import ParallelDims
    from forja.parallel.tp import local_value, loss_context
    from forja.train.build import build_model_parts

    dims = ParallelDims(Degrees(dp_shard=world // tp, tp=tp))
    if world > 1:  # one process needs no mesh: it runs in the test's own process
        dims.build_mesh("cpu")
    cfg = ParallelConfig(tp=tp, dp_shard=world // tp, sequence_parallel=sp)
    args = model_args("qwen3", "debug-moe")
    model = build_model_parts(args, dims, cfg, device=torch.device("cpu"), seed=0).parts[0]
    rows: dict[int, int] = {}
    for i, moe in moe_layers(model):  # registered after any dispatch hook: the rows this rank computes
        moe.experts.register_forward_pre_hook(lambda m, inp, i=i: rows.__setitem__(i, rows.get(i, 0) + len(inp[0])))
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with loss_context(tp):
        loss = model(tokens, labels=tokens.roll(-1, 1))
        loss.backward()
    gate = model.layers["1"].feed_forward.router.gate.weight.grad
    gate = gate.full_tensor() if hasattr(gate, "full_tensor") else gate
    return float(local_value(loss)), rows, gate


def test_tp_splits_the_expert_work_over_its_ranks():
    """Without sequence parallelism: the layer slices its replicated input and gathers its
    output (with SP the input arrives split; the same counts, measured, and the parity above)."""
    from forja.testing import run_distributed

    sp = False

    loss1, rows1, gate1 = _expert_rows(0, 1, 1, False)  # the reference, in this process (no spawn to wait for)
    results = run_distributed(_expert_rows, 2, 2, sp, timeout_s=120)
    tokens_k = 2 * 32 * 2  # B x T x top_k token-slots per layer (dropless)
    assert rows1 and all(r == tokens_k for r in rows1.values())
    for layer in rows1:
        per_rank = [rows[layer] for _, rows, _ in results]
        assert sum(per_rank) == tokens_k  # every slot computed once over the TP group: 1/tp per rank on average
        assert max(per_rank) < tokens_k  # (replicated, each TP rank would compute all tokens_k)
    for loss, _, gate in results:
        assert abs(loss - loss1) < 1e-5
        torch_close(gate, gate1)


def torch_close(a, b):
    import torch

    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
