"""Muon under data, tensor and pipeline parallelism reproduces the single-process Muon losses
(CPU, Gloo, fp32), and its sharded state resumes in one process.

Muon orthogonalizes whole matrices: under FSDP and TP each matrix's blocks are gathered to
its owner, which orthogonalizes it and sends each rank its block back (forja/optim/muon.py,
exchange.py); a test holds each rank to its share of that work and traffic. MuonClip (QK-clip
after each step) under FSDP matches one process too. The measured differences are printed
(pytest -s).
"""

from __future__ import annotations

import shutil

import pytest

from forja.cli import main
from tests.distributed.parity import (
    COMMON,
    PP_COMMON,
    RESUME_STEP,
    SAVE_HALFWAY,
    SharedLayouts,
    max_difference,
    single_process_losses,
    stop_halfway,
)
from tests.integration.conftest import losses, train_args

# The brief's bound. NS amplifies the last-place differences of summed gradients a little, but
# in fp32 on CPU the layouts stay close to what AdamW measures (tests/distributed/parity.py).
MUON_TOL = 1e-5
MUON = {"optim.name": '"muon"', "optim.lr": "0.02", "optim.muon.adamw_lr": "0.003"}


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory, train_data):
    return single_process_losses(tmp_path_factory.mktemp("ref-muon") / "run", train_data, **MUON)


LAYOUTS = {
    "FSDP 2 x TP 2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    "PP 2": (2, {**PP_COMMON, "parallel.pp": "2"}),
}
MOE = {"model.family": '"qwen3"', "model.flavor": '"debug-moe"'}
# A fresh debug Llama's logits are about 0.2: tau 0.15 clips heads at every step.
CLIP = {**MUON, "optim.qk_clip_tau": "0.15"}
# Every Muon layout of this file trains in a shared process group per rank count (one start-up
# each rather than one torchrun each); the first test of a group trains the whole group.
SHARED = {**{name: (nproc, {**MUON, **changes}) for name, (nproc, changes) in LAYOUTS.items()},
          "FSDP 2, saved halfway": (2, {**MUON, **SAVE_HALFWAY, "parallel.dp_shard": "2"}),
          "EP 2 x FSDP 2 (qwen3 debug-moe)": (4, {**MUON, **MOE, "parallel.ep": "2", "parallel.dp_shard": "4"}),
          "MuonClip FSDP 2": (2, {**CLIP, "parallel.dp_shard": "2"})}
GROUP_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, train_data):
    return SharedLayouts(tmp_path_factory, train_data, SHARED)


@GROUP_TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_single_process(name, tmp_path, muon_reference, shared_runs):
    diff = max_difference(muon_reference, losses(shared_runs.run(name, tmp_path / "run")))
    print(f"muon parity {name}: max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL


@GROUP_TIMEOUT
def test_muon_fsdp_matches_and_its_checkpoint_resumes_in_one_process(tmp_path, train_data, muon_reference,
                                                                      shared_runs):
    run = tmp_path / "run"  # a copy, since it resumes
    shutil.copytree(shared_runs.run("FSDP 2, saved halfway", tmp_path / "alone"), run)
    diff = max_difference(muon_reference, losses(run))
    print(f"muon parity FSDP 2: max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL
    stop_halfway(run)
    assert main(train_args(run, train_data, **{**COMMON, **MUON, **SAVE_HALFWAY})) == 0
    diff = max_difference(muon_reference, losses(run))
    print(f"muon resharding FSDP 2 -> 1 process after step {RESUME_STEP}: max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL


@GROUP_TIMEOUT
def test_muon_expert_parallel_matches_single_process(tmp_path, train_data, shared_runs):
    # Stacked experts sharded over "ep" and FSDP ("efsdp"): gathered over efsdp only, each EP
    # rank orthogonalizes its own experts.
    reference = single_process_losses(tmp_path / "ref", train_data, **MUON, **MOE)
    run = losses(shared_runs.run("EP 2 x FSDP 2 (qwen3 debug-moe)", tmp_path / "run"))
    diff = max_difference(reference, run)
    print(f"muon parity EP 2 x FSDP 2 (qwen3 debug-moe): max |loss diff| = {diff:.2e}")
    assert diff < MUON_TOL


# -- who does the work: Newton-Schulz calls and bytes per rank (FSDP 2, in-process ranks) ------

def _muon_model_steps(world: int, steps: int = 2):
    """The debug Llama (2 layers) under FSDP over `world` ranks (or one process when world is
    1), Muon stepped `steps` times on seeded gradients; the counters cover the last step."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from forja.models import model_args
    from forja.optim import exchange, muon
    from forja.optim.config import OptimConfig
    from forja.optim.optimizers import build_optimizer
    from forja.parallel import ParallelConfig, ParallelDims
    from forja.train.build import build_model_parts

    cfg = ParallelConfig(dp_shard=world)
    dims = ParallelDims.from_config(cfg, world)
    if world > 1:
        dims.build_mesh("cpu")
    model = build_model_parts(model_args("llama", "debug", n_layers=2), dims, cfg, device=torch.device("cpu"),
                              seed=0).parts[0]
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.02))
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        muon.NS_COUNT.clear()
        exchange.COMM.reset()
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else g
        opt.step()
    muon_names = [n for n, p in model.named_parameters() if opt.state[p].get("momentum_buffer") is not None]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return dict(muon.NS_COUNT), (exchange.COMM.collectives, exchange.COMM.bytes_received), \
        [shapes[n] for n in muon_names], weights


def _fsdp_worker(rank: int, world: int):
    return _muon_model_steps(world)


def _expected(shapes: list[tuple[int, int]], world: int) -> tuple[list[int], list[int]]:
    """Per rank: matrices owned and bytes received (fp32), from the rule: largest matrix first,
    to the least-loaded rank (ties: the lower rank); FSDP row blocks of ceil(m / world) rows."""
    load, owned, received = [0] * world, [0] * world, [0] * world
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i)):
        m, n = shapes[i]
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += m * n
        owned[owner] += 1
        chunk = -(-m // world)
        rows = [max(0, min(chunk, m - r * chunk)) for r in range(world)]
        for r in range(world):
            # The owner receives every block but its own; every other rank its block of the result.
            received[r] += 4 * ((m - rows[r]) * n if r == owner else rows[r] * n)
    return owned, received


def test_each_rank_orthogonalizes_its_share_and_receives_about_what_it_owns():
    from forja.testing import run_distributed

    world = 2
    results = run_distributed(_fsdp_worker, world, timeout_s=120)
    shapes = results[0][2]
    owned, received = _expected(shapes, world)
    ns = [r[0]["matrices"] for r in results]
    comm = [r[1] for r in results]
    print(f"muon FSDP {world}: NS matrices per rank {ns} of {len(shapes)}; (collectives, bytes received) {comm}")
    assert ns == owned and sum(ns) == len(shapes) and max(ns) - min(ns) <= 1
    assert [c[1] for c in comm] == received
    assert all(c[0] == 2 for c in comm)  # one bucket: gather to the owners, results back
    whole = sum(4 * m * n for m, n in shapes)
    assert all(b < 0.6 * whole for b in received)  # the old all-gather + broadcast received ~2x whole
    _, _, _, single = _muon_model_steps(1)
    diff = max((results[0][3][n] - w).abs().max().item() for n, w in single.items())
    print(f"muon FSDP {world} vs one process after 2 steps: max |weight diff| = {diff:.2e}")
    assert diff < 1e-6


# -- MuonClip: QK-clip after each Muon step, under FSDP --------------------------------------


def _attn(run):
    from tests.integration.conftest import read_metrics

    return {r["step"]: r for r in read_metrics(run) if "attn/max_logit" in r}


@GROUP_TIMEOUT
def test_muonclip_fsdp_matches_single_process(tmp_path, train_data, shared_runs):
    reference = single_process_losses(tmp_path / "ref", train_data, **CLIP)
    run = shared_runs.run("MuonClip FSDP 2", tmp_path / "run")
    diff = max_difference(reference, losses(run))
    one, two = _attn(tmp_path / "ref"), _attn(run)
    logit_diff = max(abs(one[s]["attn/max_logit"] - two[s]["attn/max_logit"]) for s in one)
    print(f"MuonClip parity FSDP 2: max |loss diff| = {diff:.2e}, max |max-logit diff| = {logit_diff:.2e}")
    assert diff < MUON_TOL and logit_diff < 1e-4
    assert all(one[s]["attn/clipped_heads"] == two[s]["attn/clipped_heads"] for s in one)
    assert sum(r["attn/clipped_heads"] for r in one.values()) > 0
