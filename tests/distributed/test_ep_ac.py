"""Op-level selective activation checkpointing of an MoE block under expert parallelism (2 Gloo
ranks). Backward recomputes the block; its all-to-alls (the counts, the rows there and back)
must not run again: op-level AC keeps what they received (forja/parallel/ac.py), so a step
communicates as much as without checkpointing. The router's top-k is kept too: the recomputed
block routes with the forward's picks, which the kept rows were sent by. Gradients are bit for
bit those without checkpointing."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from forja.testing import run_distributed
from tests.distributed.test_ep import DIM, _layer, _tokens


class _Block(nn.Module):
    """A pre-norm residual MoE block: what op-level AC wraps in a model."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.norm, self.moe = nn.RMSNorm(DIM), moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def _watch():
    """A dispatch mode counting the collectives by phase ("forward", "backward": set `phase`),
    keeping the router's top-k picks and the forward's collective outputs (weak references)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        phase = "forward"

        def __init__(self):
            super().__init__()
            self.collectives = {"forward": 0, "backward": 0}
            self.picks: dict[str, list[torch.Tensor]] = {"forward": [], "backward": []}
            self.received: list[weakref.ref] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace in ("c10d", "_c10d_functional") and func._opname != "wait_tensor":
                self.collectives[self.phase] += 1
                if self.phase == "forward" and isinstance(out, torch.Tensor):
                    self.received.append(weakref.ref(out.untyped_storage()))
            if func is torch.ops.aten.topk.default:
                self.picks[self.phase].append(out[1].clone())  # (values, indices) at this level
            return out

    return Watch()


def _run(rank: int, ep_mesh, kw: dict, sizes: list[int], ties: bool, ac: str) -> dict:
    from torch.distributed.tensor import DTensor

    from forja.parallel.ac import CheckpointedBlock
    from forja.parallel.ep import apply_ep

    moe = _layer(**kw)
    if ties:  # experts 0 and 1 score alike for every token, 2 and 3 too
        with torch.no_grad():
            moe.router.gate.weight[1] = moe.router.gate.weight[0]
            moe.router.gate.weight[3] = moe.router.gate.weight[2]
    apply_ep(moe, ep_mesh)
    block = _Block(moe)
    if ac != "none":
        block = CheckpointedBlock(block, op_level=True, alternate=ac == "alternate")
    x = _tokens(rank, sizes[rank]).requires_grad_()
    with _watch() as watch:
        out = block(x)
        gc.collect()
        kept = sum(ref() is not None for ref in watch.received)  # the forward's exchanges still held
        watch.phase = "backward"
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for n, p in block.named_parameters()}
    return {"collectives": watch.collectives, "kept": kept, "picks": watch.picks, "out": out.detach(),
            "x_grad": x.grad, "grads": grads}


MODES = ("none", "op-level", "alternate")


def _cases(rank: int, world: int, cases: list) -> list[dict]:
    from forja.parallel.degrees import Degrees
    from forja.parallel.dims import ParallelDims

    dims = ParallelDims(Degrees(dp_shard=world, ep=world))
    dims.build_mesh("cpu")
    return [{ac: _run(rank, dims.ep_mesh, kw, sizes, ties, ac) for ac in MODES} for kw, sizes, ties in cases]


CASES = [
    (dict(), [6, 6], False),
    (dict(score_func="sigmoid", expert_bias=True, n_shared_experts=1, aux_loss_weight=0.1), [5, 9], False),
    (dict(capacity_factor=0.5), [8, 8], False),
    (dict(), [6, 6], True),
]
IDS = ["top-2", "sigmoid, bias, shared expert", "capacity 0.5", "tied scores"]


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    """rank -> case -> mode -> what `_run` measured, every case in one spawn."""
    return run_distributed(_cases, 2, CASES)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_op_level_ac_runs_no_all_to_all_again(case, results):
    for of_rank in results:
        runs = of_rank[case]
        # Without AC: the counts, the rows there and back forward; the rows' gradients both ways.
        assert runs["none"]["collectives"] == {"forward": 3, "backward": 2}
        for ac in MODES[1:]:
            assert runs[ac]["collectives"] == runs["none"]["collectives"], ac
            assert runs[ac]["kept"] == 3, ac  # what they received, kept for the recompute


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_the_recomputed_block_routes_with_the_forwards_picks(case, results):
    """top-k runs once, in the forward: backward's recompute reads its kept picks (a recomputed
    top-k that broke a tie the other way would pair the kept rows with other tokens' weights)."""
    for of_rank in results:
        for ac in MODES[1:]:
            picks = of_rank[case][ac]["picks"]
            assert (len(picks["forward"]), len(picks["backward"])) == (1, 0), ac


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_op_level_ac_gradients_are_bit_identical(case, results):
    for of_rank in results:
        plain = of_rank[case]["none"]
        for ac in MODES[1:]:
            run = of_rank[case][ac]
            assert torch.equal(run["out"], plain["out"]) and torch.equal(run["x_grad"], plain["x_grad"]), ac
            assert run["grads"].keys() == plain["grads"].keys()
            for name, grad in plain["grads"].items():
                assert torch.equal(run["grads"][name], grad), (ac, name)
