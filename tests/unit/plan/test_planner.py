"""forja plan's search, layouts and model: each part can fail on its own."""

from __future__ import annotations

import pytest

from forja.errors import ForjaError
from forja.models import model_args
from forja.plan.hardware import get_hardware
from forja.plan.job import Job
from forja.plan.layout import Layout, SearchSpace, enumerate_layouts, parse_fixed, parse_layout
from forja.plan.memory import RankModel, _in_flight, inflight_chunks, predict_memory, stage_order
from forja.plan.planner import evaluate, plan, usable_memory
from forja.plan.shape import model_shape
from forja.plan.speed import bubble_fraction, predict_time


def job(flavor: str = "3.1-8b", seq: int = 8192, batch: int = 64, **kw) -> Job:
    return Job(shape=model_shape(model_args("llama", flavor), seq), seq_len=seq, global_batch_size=batch, **kw)


def test_every_enumerated_layout_spans_the_world_and_divides_the_job():
    a = model_args("llama", "3.1-8b")
    layouts = list(enumerate_layouts(64, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                                     n_experts=0, global_batch_size=64, seq_len=8192, space=SearchSpace()))
    assert len(layouts) > 100
    for lay in layouts:
        assert lay.world_size == 64
        assert 64 % lay.dp == 0 and a.n_heads % lay.tp == 0 and lay.tp <= 8
        assert (64 // lay.dp) % lay.micro_batch_size == 0
    assert {lay.pp for lay in layouts} >= {1, 2, 4, 8} and {lay.ac for lay in layouts} == {"none", "selective", "full"}


def test_sharding_divides_the_state_and_recomputation_trades_memory_for_time():
    j = job(gpu=True, bf16=True)
    one = predict_memory(j, Layout.of(dp_shard=8, micro_batch_size=1))
    two = predict_memory(j, Layout.of(dp_shard=16, micro_batch_size=1))
    assert two.optimizer_state == pytest.approx(one.optimizer_state / 2)
    assert two.parameters == pytest.approx(one.parameters / 2)
    full = Layout.of(dp_shard=8, micro_batch_size=1, ac="full")
    assert predict_memory(j, full).activations < one.activations / 5
    hw = get_hardware("h100")
    assert predict_time(j, full, hw).compute > predict_time(j, Layout.of(dp_shard=8, micro_batch_size=1), hw).compute
    zero2 = predict_memory(j, Layout.of(dp_shard=8, micro_batch_size=1, reshard_after_forward=False))
    assert zero2.gathered_parameters > 5 * one.gathered_parameters


def test_tensor_parallel_splits_weights_and_activations():
    j = job(gpu=True, bf16=True)
    base, tp = Layout.of(dp_shard=8, micro_batch_size=1), Layout.of(dp_shard=4, tp=2, micro_batch_size=1)
    assert predict_memory(j, tp).activations < 0.6 * predict_memory(j, base).activations
    assert predict_time(j, tp, get_hardware("h100")).tp_comm > 0


def test_pipeline_schedules_hold_and_idle_as_their_papers_say():
    gpipe, one_f = Layout.of(pp=4, pp_schedule="gpipe"), Layout.of(pp=4, pp_schedule="1f1b")
    inter = Layout.of(pp=4, pp_schedule="interleaved-1f1b")
    assert inflight_chunks(gpipe, 0, 16) == 16 and inflight_chunks(one_f, 0, 16) == 4
    assert inflight_chunks(one_f, 3, 16) == 1
    assert bubble_fraction(one_f, 16) == pytest.approx(3 / 16)
    assert bubble_fraction(inter, 16) == pytest.approx(3 / 32)


def test_a_ranks_stages_are_whole_together_only_where_their_backwards_interleave():
    """torch's schedules reduce a stage's gradients right after its last backward: interleaved
    1F1B over one round of pp micro-batches finishes the stage nearest the loss first."""
    inter = Layout.of(pp=4, pp_schedule="interleaved-1f1b")
    two = RankModel(pp_rank=3, stages=2)
    assert stage_order(inter, two, 16, inflight_chunks(inter, 3, 16)) == "together"  # four rounds
    assert stage_order(inter, two, 4, inflight_chunks(inter, 3, 4)) == "one at a time"  # one round
    assert stage_order(inter, two, 4, inflight_chunks(inter, 0, 4)) == "all first"  # warm-up runs all 8
    gpipe = Layout.of(pp=4, pp_schedule="gpipe")
    assert stage_order(gpipe, RankModel(pp_rank=0), 16, inflight_chunks(gpipe, 0, 16)) == "all first"


def test_interleaved_warm_up_runs_a_ranks_first_stage_more_often_than_its_last():
    """torch's interleaved 1F1B runs a round of micro-batches through one stage, then the next:
    the last pp rank (stages 7 and 15 of 16) runs 8 forwards of stage 7, then stage 15's round,
    then a ninth of stage 7 before that stage's first backward. A thin last stage (DeepSeek-V3's,
    thinned for the output layer) so keeps less than the mean of its stages would say (measured
    by the rehearsal: 125.3 GiB, predicted 127.7, where the mean said 114.6)."""
    inter = Layout.of(pp=8, pp_schedule="interleaved-1f1b")
    assert _in_flight(inter, 7, 16, [4.0, 2.0]) == 9 * 4.0
    assert _in_flight(inter, 7, 16, [3.0, 3.0]) == inflight_chunks(inter, 7, 16) * 6.0  # even stages: the mean
    assert _in_flight(inter, 0, 8, [4.0, 2.0]) == 8 * 4.0 + 8 * 2.0  # one round: every forward first
    one_f = Layout.of(pp=8, pp_schedule="1f1b")
    assert _in_flight(one_f, 0, 16, [5.0]) == 8 * 5.0


def test_the_search_ranks_fitting_layouts_first_and_says_why_others_do_not():
    j = job(batch=16, gpu=True, bf16=True)
    ranked = plan(j, get_hardware("h100"), 8)
    fits = [c for c in ranked if c.fits]
    assert fits and ranked[: len(fits)] == fits
    assert [c.tokens_per_sec for c in fits[:20]] == sorted((c.tokens_per_sec for c in fits[:20]), reverse=True) or \
        fits[0].tokens_per_sec >= 0.99 * max(c.tokens_per_sec for c in fits)
    assert all(c.memory.total <= usable_memory(get_hardware("h100")) for c in fits)
    refused = [c for c in ranked if not c.fits]
    assert refused and all(c.why_not for c in refused)
    one_gpu = evaluate(j, Layout(micro_batch_size=1), get_hardware("h100"))  # 8B with AdamW on one 80 GB GPU
    assert not one_gpu.fits and "needs" in one_gpu.why_not


def test_a_layout_the_trainer_would_refuse_is_refused_with_its_reason():
    j = job(batch=16)
    assert "heads" in evaluate(j, Layout.of(tp=3, dp_shard=1), get_hardware("h100")).why_not
    assert "divisible" in evaluate(j, Layout.of(dp_shard=3), get_hardware("h100")).why_not


def test_parse_layout_sets_keys_and_names_bad_ones():
    lay = parse_layout("parallel.dp_shard=2, parallel.tp=2,train.micro_batch_size=4,parallel.ac=full", Layout())
    assert (lay.dp_shard, lay.tp, lay.micro_batch_size, lay.ac) == (2, 2, 4, "full")
    assert parse_layout("parallel.reshard_after_forward=false", Layout()).reshard_after_forward is False
    with pytest.raises(ForjaError, match="parallel.bogus"):
        parse_layout("parallel.bogus=1", Layout())
    with pytest.raises(ForjaError, match="integer"):
        parse_layout("parallel.tp=two", Layout())


def test_layout_values_are_read_as_set_reads_them_and_checked_against_the_key():
    """--layout and --set spell values alike: TOML, else a bare string; each checked as the key's
    annotation says (a quoted string was once held with its quotes, and planned)."""
    assert parse_fixed('parallel.ac="selective"') == parse_fixed("parallel.ac=selective") == {"ac": "selective"}
    assert parse_fixed("parallel.tp=2,parallel.sequence_parallel=false,train.micro_batch_size=4") == {
        "tp": 2, "sequence_parallel": False, "micro_batch_size": 4}
    with pytest.raises(ForjaError, match=r"^parallel.ac = 'bogus' is not valid: it must be one of 'none', 'full', "
                                         r"'selective'$"):
        parse_fixed("parallel.ac=bogus")
    with pytest.raises(ForjaError, match="parallel.pp_schedule = 'gpipe2' is not valid: it must be one of 'gpipe'"):
        parse_fixed("parallel.pp_schedule=gpipe2")
    with pytest.raises(ForjaError, match="parallel.tp = 0 must be at least 1"):
        parse_fixed("parallel.tp=0")


def test_a_mixture_of_experts_splits_its_experts_over_ep():
    args = model_args("qwen3", "30b-a3b")
    j = Job(shape=model_shape(args, 4096), seq_len=4096, global_batch_size=64, gpu=True, bf16=True)
    ep1 = predict_memory(j, Layout.of(dp_shard=8, micro_batch_size=1))
    ep8 = predict_memory(j, Layout.of(dp_shard=8, ep=8, micro_batch_size=1))
    assert ep8.gathered_parameters < 0.5 * ep1.gathered_parameters  # a block gathers 1/8 of the experts
    assert ep8.parameters == pytest.approx(ep1.parameters)  # either way each rank keeps 1/8 of everything
    assert predict_time(j, Layout.of(dp_shard=8, ep=8, micro_batch_size=1), get_hardware("h100")).ep_comm > 0


def test_cpu_offload_frees_device_memory_and_costs_the_host_optimizer_step():
    j, hw = job(gpu=True, bf16=True), get_hardware("h100")
    on, off = Layout.of(dp_shard=8, micro_batch_size=1, cpu_offload=True), Layout.of(dp_shard=8, micro_batch_size=1)
    assert predict_memory(j, on).optimizer_state == 0 < predict_memory(j, off).optimizer_state
    assert predict_time(j, on, hw).offload > 0.5 * predict_time(j, off, hw).compute / 8  # seconds, not noise
    assert predict_time(j, off, hw).offload == 0
