"""Multi-token prediction under FSDP: 2 Gloo ranks, each with one row of the batch, give
the losses of one process holding both (main loss and each depth's, three steps)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.conftest import dims  # noqa: F401  (the one-process mesh of the reference)
from tests.unit.models.test_mtp import Batch, _batch, _engine


def _fsdp_batches(rows: slice) -> list[Batch]:
    tokens, labels, _ = _batch(T=32, seed=5)
    docs = torch.tensor([[0] * 12 + [1] * 20] * 2)  # both rows alike: each rank's mean is a mean of as many terms
    return [Batch(tokens[rows], labels[rows], docs[rows])]


def _fsdp_run(rank: int, world: int) -> list:
    from forja.parallel import ParallelConfig, ParallelDims

    mesh = ParallelDims.from_config(ParallelConfig(dp_shard=world), world)
    mesh.build_mesh("cpu")
    engine = _engine(mesh, depth=2, parallel=ParallelConfig(dp_shard=world))
    outs = [engine.train_step(_fsdp_batches(slice(rank, rank + 1))) for _ in range(3)]
    return [(o.loss, o.metrics["mtp/loss_1"], o.metrics["mtp/loss_2"]) for o in outs]


@pytest.mark.slow  # two spawned ranks
def test_fsdp_over_2_ranks_trains_as_one_process(dims):  # noqa: F811
    from forja.testing import run_distributed

    engine = _engine(dims, depth=2)  # the same model, both rows in one micro-batch
    ref = [engine.train_step(_fsdp_batches(slice(0, 2))) for _ in range(3)]
    ref = [(o.loss, o.metrics["mtp/loss_1"], o.metrics["mtp/loss_2"]) for o in ref]
    for rank in run_distributed(_fsdp_run, 2):
        worst = max(abs(a - b) for step, ref_step in zip(rank, ref, strict=True) for a, b in zip(step, ref_step))
        print(f"FSDP vs one process, 3 steps: max |loss diff| = {worst:.2e}")
        assert worst < 1e-5
