"""The step hooks' collectives on 2 Gloo ranks: a step of a mixture of experts with
multi-token prediction and the max-logit metric reduces its loss, its hooks' values and their
maxima in one collective per reduce type and dtype (the loss and the MTP means: float32 sums;
the experts' counts: a float64 sum; the attention maxima: a float32 max) and syncs with the
host once; under a pipeline every stage's layers reach every rank through the same sums."""

from __future__ import annotations

import pytest

from tests.unit.train.step.test_hooks import batches, counted_step, engine


def _count(rank: int, world: int, pp: int, moe: bool) -> tuple[int, int, dict]:
    import pytest as _pytest

    from forja.parallel import ParallelConfig, ParallelDims

    cfg = ParallelConfig(pp=pp, dp_shard=world // pp)
    dims = ParallelDims.from_config(cfg, world)
    dims.build_mesh("cpu")
    step_engine = engine(dims, cfg, moe=moe)
    rows = slice(0, 2) if pp > 1 else slice(rank, rank + 1)  # the data ranks split the rows
    # The second step is counted: a pipeline's first runs the library's shape inference too, whose
    # forward on empty tensors also reaches the last stage's statistics (forja/parallel/pp.py).
    step_engine.train_step(batches(n=2, rows=rows, seed=1))
    with _pytest.MonkeyPatch.context() as monkeypatch:
        return counted_step(step_engine, monkeypatch, batches(n=2, rows=rows))


@pytest.mark.slow  # two spawned ranks a layout
@pytest.mark.parametrize("pp, moe, collectives", [
    (1, True, 3),  # loss + mtp (sum, float32), experts (sum, float64), attention (max)
    (1, False, 1),  # a dense model: the loss alone, as before hooks
    # The tied embedding's copies and the norm over the stages, as before hooks; then the three
    # buckets over the stages (one data rank).
    (2, True, 5),
])
def test_one_collective_per_reduce_type_and_one_host_sync(pp, moe, collectives):
    from forja.testing import run_distributed

    results = run_distributed(_count, 2, pp, moe)
    for syncs, made, _ in results:
        assert (syncs, made) == (1, collectives)
    if moe:  # every rank logs every layer of the model (a stage's own and the other's)
        first, second = (metrics for _, _, metrics in results)
        layers = {k for k in first if k.startswith("moe/layer")}
        assert {"moe/layer1/load_cv", "moe/layer3/load_cv", "attn/layer0/max_logit", "attn/layer3/max_logit"} \
            <= set(first) and layers == {k for k in second if k.startswith("moe/layer")}
        assert first == second
