"""Pipeline stage splitting and schedule checks, without processes (forja/parallel/pp_split.py, pp.py)."""

from __future__ import annotations

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model
from forja.parallel.config import ParallelConfig
from forja.parallel.degrees import Degrees
from forja.parallel.dims import ParallelDims
from forja.parallel.pp import check_microbatches, check_pipeline, check_schedule, microbatch_error
from forja.parallel.pp_split import (
    StageCosts,
    balanced_layers,
    check_layers,
    layers_per_stage,
    model_costs,
    rank_stages,
    stage_owners,
    stage_part,
)


def _llama(n_layers: int):
    return build_model("llama", "debug", device="meta", n_layers=n_layers, tie_embeddings=False)


def _split(model, pp: int, schedule: str = "1f1b", pp_layers=()) -> list[int]:
    return layers_per_stage(model, pp=pp, schedule=schedule, pp_layers=list(pp_layers), seq_len=64)


def test_equal_blocks_spread_evenly_when_the_ends_cost_nothing():
    assert balanced_layers(4, 2, StageCosts(block=1.0)) == [2, 2]
    assert balanced_layers(16, 4, StageCosts(block=1.0)) == [4, 4, 4, 4]
    assert balanced_layers(7, 2, StageCosts(block=1.0)) == [4, 3]  # the remainder goes first


def test_the_stage_paying_for_the_output_gets_fewer_blocks():
    # Output = 1.5 blocks: [5, 4, 4, 3] costs [5, 4, 4, 4.5]; an even [4, 4, 4, 4] would cost 5.5.
    assert balanced_layers(16, 4, StageCosts(block=1.0, last=1.5)) == [5, 4, 4, 3]
    assert balanced_layers(16, 4, StageCosts(block=1.0, first=2.0)) == [3, 5, 4, 4]  # costs [5, 5, 4, 4]


def test_no_stage_ends_inside_a_span_of_blocks_that_share_one():
    # Blocks 3..6 together: the even [4, 4, 4, 4] would cut them; of the splits whose costliest
    # stage holds 5, [3, 5, 4, 4] is the most even with more blocks early.
    span = [(3, 6, "they hand each other keys")]
    assert balanced_layers(16, 4, StageCosts(block=1.0), span) == [3, 5, 4, 4]
    assert balanced_layers(6, 2, StageCosts(block=1.0), [(2, 5, "")]) == [2, 4]  # the span ends the model
    assert balanced_layers(16, 4, StageCosts(block=1.0), [(4, 7, "")]) == [4, 4, 4, 4]  # cuts at 4 and 8 are free
    # A span that forbids no cut: the split is water filling's.
    assert balanced_layers(16, 4, StageCosts(block=1.0, last=1.5), [(0, 0, "")]) == [5, 4, 4, 3]


def test_a_span_refuses_a_cut_inside_it_and_too_many_stages():
    span = [(2, 5, "blocks 4-5 read blocks 2-3")]
    check_layers(8, pp=2, schedule="1f1b", pp_layers=[2, 6], spans=span)
    with pytest.raises(ForjaError, match=r"parallel.pp_layers = \[4, 4\] ends a stage after block 3, but blocks 2 "
                                         r"to 5 must share a stage \(blocks 4-5 read blocks 2-3\)"):
        check_layers(8, pp=2, schedule="1f1b", pp_layers=[4, 4], spans=span)
    check_layers(6, pp=3, schedule="1f1b", pp_layers=[], spans=span)  # cuts after blocks 0 and 1
    with pytest.raises(ForjaError, match=r"n_layers = 6 \(blocks 4-5 read blocks 2-3, so they share a stage\) but "
                                         r"the pipeline has 4 stages"):
        check_layers(6, pp=4, schedule="1f1b", pp_layers=[], spans=span)


@pytest.mark.parametrize(("n_layers", "pp", "schedule", "expected"), [
    (4, 2, "1f1b", [3, 1]),
    (8, 2, "gpipe", [5, 3]),
    (8, 4, "1f1b", [3, 2, 2, 1]),
    (16, 2, "1f1b", [9, 7]),
    (16, 4, "1f1b", [5, 4, 4, 3]),
    (16, 2, "interleaved-1f1b", [5, 4, 4, 3]),  # 2 stages per rank: 4 stages
    (8, 2, "zero-bubble", [3, 2, 2, 1]),
])
def test_debug_llama_split_by_cost(n_layers, pp, schedule, expected):
    # The debug model's output projection (128 x vocab 2048) costs ~1.23 blocks at T = 64.
    model = _llama(n_layers)
    costs = model_costs(model, 64)
    assert costs.first == 0 and 1.2 < costs.last / costs.block < 1.3
    assert _split(model, pp, schedule) == expected


def test_explicit_pp_layers_are_taken_as_given():
    assert _split(_llama(8), 2, pp_layers=[2, 6]) == [2, 6]
    assert _split(_llama(8), 2, "dualpipev", pp_layers=[1, 3, 3, 1]) == [1, 3, 3, 1]
    assert _split(_llama(4), 2, pp_layers=[4, 0]) == [4, 0]  # a last stage of just norm + output


@pytest.mark.parametrize(("pp_layers", "words"), [
    ([2, 2, 4], "has 3 entries but the pipeline has 2 stages"),
    ([3, 4], "adds up to 7 but the model has n_layers = 8"),
    ([4, 0, 3, 1], "stage 1 gets 0 blocks"),
    ([9, -1], "stage 1 gets -1 blocks"),
])
def test_bad_pp_layers_are_refused_by_name(pp_layers, words):
    schedule = "interleaved-1f1b" if len(pp_layers) == 4 else "1f1b"
    with pytest.raises(ForjaError, match="parallel.pp_layers") as err:
        _split(_llama(8), 2, schedule, pp_layers)
    assert words in str(err.value)


def test_too_few_layers_for_the_stages():
    with pytest.raises(ForjaError, match="n_layers = 4 but the pipeline has 8 stages") as err:
        _split(_llama(4), 4, "interleaved-1f1b")
    assert "parallel.pp" in str(err.value)


def test_a_tied_model_splits_into_a_first_stage_embedding_and_a_last_stage_copy():
    model = build_model("llama", "debug", device="meta", n_layers=4)  # the debug flavor is tied
    assert model.args.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    first, last = (stage_part(model, s, [2, 2]) for s in (0, 1))
    assert first.output is None and last.tok_embeddings is None
    assert first.tied_parameters() == {"tok_embeddings.weight": "tok_embeddings.weight"}
    assert last.tied_parameters() == {"output.weight": "tok_embeddings.weight"}
    assert model.tied_parameters() == {"tok_embeddings.weight": "tok_embeddings.weight",
                                       "output.weight": "tok_embeddings.weight"}


def test_the_last_stage_copy_starts_equal_to_the_embedding():
    whole = build_model("llama", "debug", n_layers=4, seed=3)
    last = stage_part(build_model("llama", "debug", device="meta", n_layers=4), 1, [2, 2])
    last.to_empty(device="cpu")
    last.init_weights(3)
    assert torch.equal(last.output.weight, whole.tok_embeddings.weight)
    assert torch.equal(last.layers["3"].attention.wq.weight, whole.layers["3"].attention.wq.weight)


def test_which_rank_runs_which_stage():
    assert [rank_stages(r, 4, "1f1b") for r in range(4)] == [[0], [1], [2], [3]]
    assert [rank_stages(r, 2, "interleaved-1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stages(r, 2, "zero-bubble") for r in range(2)] == [[0, 3], [1, 2]]  # a V
    assert stage_owners(4, "dualpipev") == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stage_parts_keep_whole_model_names_and_cover_it_once(family):
    model = build_model(family, "debug", device="meta", n_layers=4, tie_embeddings=False)
    counts = [1, 2, 1]
    parts = [stage_part(model, s, counts) for s in range(3)]
    names = [set(n for n, _ in p.named_parameters()) for p in parts]
    whole = set(n for n, _ in model.named_parameters())
    assert set().union(*names) == whole and sum(len(n) for n in names) == len(whole)
    assert list(parts[1].layers.keys()) == ["1", "2"]
    assert parts[0].tok_embeddings is not None and parts[0].output is None and parts[0].norm is None
    assert parts[2].tok_embeddings is None and parts[2].output is not None
    if family == "gpt2":  # learned positions feed the first block only
        assert [getattr(p, "pos_embeddings") is not None for p in parts] == [True, False, False]
    assert len(model.layers) == 4  # the whole model is left as it was


def test_stages_chained_compute_what_the_whole_model_does():
    model = build_model("llama", "debug", n_layers=4, tie_embeddings=False, seed=3)
    counts = [1, 2, 1]
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    doc_ids = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])
    h = tokens
    for s in range(3):
        h = stage_part(model, s, counts)(h, document_ids=doc_ids)
    torch.testing.assert_close(h, model(tokens, doc_ids), rtol=0, atol=0)


@pytest.mark.parametrize(("schedule", "pp", "n", "local", "words"), [
    ("1f1b", 2, 2, 8, None),
    ("1f1b", 4, 2, 8, "needs at least 4 microbatches"),
    ("gpipe", 4, 1, 8, None),
    ("dualpipev", 2, 3, 6, "needs at least 4 microbatches"),
    ("zero-bubble", 2, 1, 2, None),
    ("interleaved-1f1b", 2, 3, 6, None),  # one round of 3
    ("interleaved-1f1b", 2, 5, 10, "must be divisible by n // parallel.pp"),
    ("interleaved-1f1b", 2, 6, 12, None),
    ("1f1b", 2, 3, 8, "does not split into"),
])
def test_microbatch_needs_of_each_schedule(schedule, pp, n, local, words):
    error = microbatch_error(schedule, pp, n, local, f"parallel.pp_microbatches = {n}")
    if words is None:
        assert error is None
    else:
        assert words in error and "parallel.pp_microbatches" in error and "train.micro_batch_size" in error


def test_microbatches_checked_from_the_batch_sizes():
    cfg, dims = ParallelConfig(pp=2, pp_schedule="1f1b"), ParallelDims(Degrees(pp=2, dp_shard=2))  # pp 2 x dp 2
    check_microbatches(cfg, dims, global_batch_size=8, micro_batch_size=2)  # local 4: 2 microbatches
    with pytest.raises(ForjaError, match=r"at least 2 microbatches .* gets 1 \(local batch / "
                                         r"train.micro_batch_size = 4 / 4\)"):
        check_microbatches(cfg, dims, global_batch_size=8, micro_batch_size=4)
    explicit = ParallelConfig(pp=2, pp_schedule="1f1b", pp_microbatches=3)
    with pytest.raises(ForjaError, match=r"does not split into 3 equal microbatches \(parallel.pp_microbatches = 3\)"):
        check_microbatches(explicit, dims, global_batch_size=8, micro_batch_size=2)


def test_v_schedules_refuse_what_cannot_split_a_backward():
    gpu = "cuda"  # on CPU, torch < 2.12 refuses V schedules before these checks
    check_schedule(ParallelConfig(pp=2, pp_schedule="1f1b", compile=True, ac="selective"), gpu)
    check_schedule(ParallelConfig(pp=2, pp_schedule="zero-bubble", ac="selective", ac_every=2), gpu)
    with pytest.raises(ForjaError, match="parallel.compile = false"):
        check_schedule(ParallelConfig(pp=2, pp_schedule="zero-bubble", compile=True), gpu)
    with pytest.raises(ForjaError, match="parallel.ac = 'full' or parallel.ac_every = k"):
        check_schedule(ParallelConfig(pp=2, pp_schedule="dualpipev", ac="selective"), gpu)


@pytest.mark.parametrize(("version", "refused"), [((2, 11), True), ((2, 12), False), ((2, 13), False)])
def test_v_schedules_on_gloo_need_torch_2_12(monkeypatch, version, refused):
    # The check reads the installed version; give it each side of the boundary.
    monkeypatch.setattr("forja.parallel.pp.torch_version", lambda: version)
    cfg, cpu = ParallelConfig(pp=2, pp_schedule="zero-bubble"), "cpu"
    if refused:
        with pytest.raises(ForjaError, match="needs PyTorch >= 2.12"):
            check_schedule(cfg, cpu)
    else:
        check_schedule(cfg, cpu)
    check_schedule(ParallelConfig(pp=2, pp_schedule="1f1b"), cpu)  # only V schedules need it
    check_schedule(cfg, "cuda")  # NCCL sends to itself


def test_whole_layout_checked_before_the_model_is_built():
    """check_pipeline (called by forja/parallel/checks.py) gives each error without a model."""
    dims, gpu = ParallelDims(Degrees(pp=2)), "cuda"
    untied = _llama(4).args
    sizes = {"device_type": gpu, "global_batch_size": 8, "micro_batch_size": 2}
    check_pipeline(untied, dims, ParallelConfig(pp=2), **sizes)
    check_pipeline(build_model("llama", "debug", device="meta").args, dims, ParallelConfig(pp=2), **sizes)  # tied
    cases = [
        (untied, ParallelConfig(pp=2, pp_layers=[1, 2]), "parallel.pp_layers"),
        (untied, ParallelConfig(pp=2, pp_schedule="interleaved-1f1b", pp_microbatches=5), "divisible"),
        (untied, ParallelConfig(pp=2, pp_schedule="zero-bubble", compile=True), "parallel.compile"),
    ]
    for args, cfg, words in cases:
        with pytest.raises(ForjaError, match=words):
            check_pipeline(args, dims, cfg, **{**sizes, "global_batch_size": 10})


def test_the_last_stage_computes_the_fused_loss_without_the_logits(monkeypatch):
    """A last stage given labels returns the loss, through the fused linear cross-entropy
    when it is on: no tensor as large as the (tokens, vocab) logits appears."""
    from tests.unit.ops.test_cross_entropy import _LargestOutput

    monkeypatch.setattr("forja.ops.cross_entropy.LOGITS_BUDGET_BYTES", 4 * 2048 * 16)  # 16-row chunks
    hidden = torch.randn(4, 128, 128)  # (B, T, dim) from the previous stage
    labels = torch.randint(0, 2048, (4, 128))
    logits_size = labels.numel() * 2048
    largest = {}
    for fused in ((), ("cross_entropy",)):
        meta = build_model("llama", "debug", device="meta", n_layers=2, fused_ops=fused)
        last = stage_part(meta, 1, [1, 1])
        last.to_empty(device="cpu")
        last.init_weights(0)
        with _LargestOutput() as probe:
            loss = last(hidden, labels=labels)
            loss.backward()
        assert loss.dim() == 0
        largest[fused] = probe.largest
    assert largest[()] >= logits_size  # the probe sees the plain loss's logits
    assert largest[("cross_entropy",)] < logits_size
