"""Rehearsals of real recipes on fake devices, against the planner's prediction: a sample of
the agreement bench/rehearse.py measures at full size (docs/planner.md, "Rehearsal").

Each rehearsal runs forja's build and one step of a model with a real vocabulary and width
on a fake world in this process: seconds each, no GPU, nothing written."""

from __future__ import annotations

import functools
import json

import pytest

from forja.cli import main
from forja.config import load_config
from forja.errors import ForjaError
from forja.models.config import run_model_args
from forja.plan.hardware import get_hardware
from forja.train.rehearse.rehearsal import fewer_pipeline_microbatches, rank_positions, rehearse

# The promise docs/planner.md makes: the planner's per-rank peak within 5% of the rehearsal's.
AGREEMENT = 0.05
# Llama 3.2 1B's shape (full vocabulary and width) at 1,024 tokens a sequence: seconds a rehearsal.
SMALL = ["train.seq_len=1024", "train.global_batch_size=16", "train.micro_batch_size=1"]
# A mixture of experts with latent attention: DeepSeek-V3's debug flavor (its MoE layers routed
# as a balanced router would, forja/train/rehearse/routing.py).
DEEPSEEK = ["model.family=deepseek_v3", "model.flavor=debug"]
DEEPSEEK_EP4 = DEEPSEEK + ["parallel.dp_shard=8", "parallel.ep=4", "parallel.ac=none"]


# Megatron's distributed optimizer (parallel.grad_sync = "step"), and a 1F1B pipeline over 2 stages.
GRADS_PER_STEP = ["parallel.dp_shard=8", "parallel.reshard_after_forward=false", "parallel.grad_sync=step",
                  "parallel.mixed_precision=bf16", "parallel.ac=full"]
PP2 = ["parallel.pp=2", "parallel.dp_shard=4"]
FSDP2_TP4 = ["parallel.dp_shard=2", "parallel.tp=4", "parallel.ac=selective"]
# Full AC and an untied embedding under HSDP: the peak is the backward's end (the embedding's
# gradient made last, beside the root's others; every block's all-reduce input held until then).
HSDP_END = ["parallel.dp_shard=2", "parallel.dp_replicate=4", "parallel.ac=full",
            "model.overrides={tie_embeddings = false}"]
# Sequence parallelism without AC in bf16: each sublayer's gathered input kept split until
# backward (forja/parallel/regather.py), as Megatron-LM keeps it.
SP_REGATHERED = ["parallel.dp_shard=4", "parallel.tp=2", "parallel.ac=none", "parallel.mixed_precision=bf16"]
# Eager float8 under TP + SP without AC: torchao's Float8Linear keeps no autocast weight casts,
# and its TP styles cast the gathered inputs and w2's input to float8 before the matmuls.
FLOAT8_TP = ["parallel.dp_shard=4", "parallel.tp=2", "parallel.ac=none", "train.float8=tensorwise"]


@pytest.mark.parametrize("layout", [
    ["parallel.dp_shard=8", "parallel.ac=none"],
    ["parallel.dp_shard=4", "parallel.dp_replicate=2", "parallel.ac=selective"],
    FSDP2_TP4,
    ["parallel.dp_shard=4", "parallel.cp=2", "parallel.cp_kind=all-to-all", "parallel.ac=full"],
    DEEPSEEK_EP4,
    GRADS_PER_STEP,
    PP2,
    ["parallel.pp=2", "parallel.dp_shard=4", "parallel.pp_schedule=interleaved-1f1b", "parallel.mixed_precision=bf16"],
    ["model.family=gpt2", "model.flavor=124m", "parallel.dp_shard=4", "parallel.tp=2"],
    HSDP_END,
    SP_REGATHERED,
    ["parallel.dp_shard=4", "parallel.tp=2", "parallel.ac=selective", "parallel.ac_matmuls=alternate"],
    FLOAT8_TP,
], ids=["fsdp8", "hsdp-selective-ac", "fsdp2-tp4-sp", "fsdp4-cp2-a2a", "deepseek-v3-ep4",
        "fsdp8-grads-per-step", "pp2-1f1b", "pp2-interleaved-bf16", "gpt2-tp2-sp", "hsdp-full-ac-untied",
        "fsdp4-tp2-sp-regathered", "fsdp4-tp2-sac-alternate-mm", "fsdp4-tp2-float8"])
def test_the_planners_peak_agrees_with_the_rehearsal(layout):
    r = _rehearsed(tuple(layout))
    assert len(r.ranks) == (2 if "parallel.pp=2" in layout else 1)  # a pipeline's first and last stage
    for rank, predicted in zip(r.ranks, r.predicted):
        error = predicted.total / rank.peak_bytes - 1
        assert abs(error) <= AGREEMENT, (layout, rank.position, rank.peak_bytes, predicted.total, rank.by_category)
        # The step really ran: weights, gradients and Adam's two moments are each the rank's shard.
        by = rank.by_category
        assert by["optimizer_state"] == pytest.approx(2 * by["parameters"], rel=0.02)
        assert by["activations"] > 0 and rank.checkpoint_bytes >= 3 * by["parameters"] * 0.98


def test_the_backwards_end_is_a_moment_of_its_own():
    """Where activations are few (full AC) the rank peaks as the embedding's backward ends the
    step: the walk names that moment, and agrees with the rehearsal there (above)."""
    r = _rehearsed(tuple(HSDP_END))
    assert r.predicted[0].phase == "embedding backward" and r.ranks[0].peak_phase == "backward"
    assert r.ranks[0].by_category["communication"] > r.ranks[0].by_category["parameters"] / 2  # the held inputs


@functools.lru_cache(maxsize=None)
def _rehearsed(layout: tuple[str, ...]):
    """Llama 3.2 1B's shape under `layout` on 8 fake ranks, rehearsed once for every test asking."""
    return rehearse(load_config("llama3-1b", SMALL + list(layout)), 8)


def test_a_distributed_optimizer_gathers_and_reduces_once_a_step():
    """parallel.grad_sync = "step" (Megatron's distributed optimizer): FSDP keeps the gathered
    weights and whole gradients through the step's micro-batches, so each unit is gathered
    and reduce-scattered once, where the default does both for every micro-batch."""
    counts = {}
    for sync in ("micro-batch", "step"):
        rank = _rehearsed(tuple(GRADS_PER_STEP[:2] + [f"parallel.grad_sync={sync}"] + GRADS_PER_STEP[3:])).ranks[0]
        rows = {(c["kind"], c["group"]): c["count"] for c in rank.collectives}
        counts[sync] = rows[("allgather_base", "dp_shard")], rows[("reduce_scatter_base", "dp_shard")]
        assert rank.microbatches_rehearsed == 2
    units = 16 + 1  # the blocks and the root
    assert counts == {"micro-batch": (2 * units, 2 * units), "step": (units, units)}


def test_a_pipeline_stage_sends_hidden_states_and_receives_their_gradients():
    for rank in _rehearsed(tuple(PP2)).ranks:
        rows = {(c["kind"], c["group"]): c for c in rank.collectives}
        # 1F1B over 4 micro-batches: each forward's hidden states one way, its gradient the other,
        # and the schedule's start-up vote (forja/train/rehearse/pipeline.py) once each way.
        assert rows[("send", "pp")]["count"] == rows[("recv", "pp")]["count"] == 4 + 1
        assert rows[("send", "pp")]["bytes"] >= 4 * 1024 * 2048 * 4  # (1, 1024, dim) fp32 each


def test_collectives_are_counted_by_kind_and_mesh_group():
    r = _rehearsed(tuple(FSDP2_TP4))  # the agreement test's
    rows = {(c["kind"], c["group"]): c for c in r.ranks[0].collectives}
    # FSDP gathers each block's weights in forward and again in backward, and reduce-scatters
    # each block's gradients once per micro-batch, over dp_shard; TP moves activations over tp.
    blocks = 16
    gathers, scatters = rows[("allgather_base", "dp_shard")], rows[("reduce_scatter_base", "dp_shard")]
    assert gathers["count"] >= 2 * blocks * r.ranks[0].microbatches_rehearsed
    assert scatters["count"] >= blocks * r.ranks[0].microbatches_rehearsed
    assert any(group == "tp" for _, group in rows)


def test_experts_move_their_rows_over_the_ep_group_as_routed():
    cfg = load_config("llama3-1b", SMALL + DEEPSEEK_EP4)
    r = _rehearsed(tuple(DEEPSEEK_EP4))  # the agreement test's
    rank = r.ranks[0]
    args = run_model_args(cfg.model, cfg.data.vocab_size)
    moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    rows = {(c["kind"], c["group"]): c for c in rank.collectives}
    # Each MoE layer, each micro-batch: the counts, the rows there and back in forward, the
    # rows' gradients both ways in backward.
    assert rows[("all_to_all_single", "ep")]["count"] == 5 * moe * rank.microbatches_rehearsed
    assert any("balanced router" in note for note in r.notes)


def test_a_long_pipeline_step_is_rehearsed_with_the_micro_batches_its_peak_needs():
    cfg = load_config("llama3-1b", ["parallel.pp=2", "parallel.dp_shard=4", "train.global_batch_size=64",
                                    "train.micro_batch_size=2"])
    fewer, note = fewer_pipeline_microbatches(cfg, 8)
    # 64 / 4 = 16 rows a rank in 8 micro-batches of 2; 1F1B over 2 stages holds at most 2 in flight.
    assert (fewer.train.global_batch_size, fewer.train.micro_batch_size) == (4 * 4 * 2, 2) and "8 micro-batches" in note
    gpipe = load_config("llama3-1b", ["parallel.pp=2", "parallel.dp_shard=4", "train.global_batch_size=64",
                                      "parallel.pp_schedule=gpipe"])
    assert fewer_pipeline_microbatches(gpipe, 8) == (gpipe, "")  # GPipe holds every micro-batch: all of them


def test_a_shortened_pipeline_step_holds_a_receive_buffer_for_each_of_the_steps_micro_batches():
    """torch allocates a stage's receive buffers for every micro-batch up front: the 16-micro-batch
    step rehearsed as 4 holds 12 more of them than the 4-micro-batch step, on each stage, and
    the planner, which prices the whole step, still agrees."""
    whole = _rehearsed(tuple(PP2))  # 16 rows a rank: 4 micro-batches of 1
    longer = _rehearsed(tuple(PP2 + ["train.global_batch_size=64"]))  # 16 micro-batches, rehearsed as 4
    buffer = 1 * 1024 * 2048 * 4  # (1, 1024, dim) fp32: hidden states in, or their gradient
    for short, long, predicted in zip(whole.ranks, longer.ranks, longer.predicted):
        assert (long.microbatches, long.microbatches_rehearsed, short.microbatches) == (16, 4, 4)
        assert long.peak_bytes - short.peak_bytes == 12 * buffer, long.position
        assert abs(predicted.total / long.peak_bytes - 1) <= AGREEMENT


def test_rank_positions_are_the_pipeline_ends():
    cfg = load_config("llama3-1b", ["parallel.pp=4", "parallel.dp_shard=2"])
    assert rank_positions(cfg, 8) == [(0, "first stage"), (6, "last stage")]
    assert rank_positions(load_config("llama3-1b"), 8) == [(0, "every rank")]
    v = load_config("llama3-1b", ["parallel.pp=2", "parallel.pp_schedule=zero-bubble", "parallel.ac=full"])
    assert rank_positions(v, 8) == [(0, "first and last stage"), (4, "middle stages")]


@pytest.mark.parametrize(("sets", "world", "says"), [
    (["parallel.dp_shard=3"], 8, "dp_shard"),
    (["model.family=deepseek_v3", "model.flavor=debug", "model.overrides={capacity_factor=1.25}"], 8,
     "capacity factor"),
])
def test_what_cannot_be_rehearsed_is_refused_before_anything_is_built(sets, world, says):
    with pytest.raises(ForjaError, match=says):
        rehearse(load_config("llama3-1b", SMALL + sets), world)


def test_forja_plan_rehearse_prints_both_and_writes_only_its_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "llama3-1b", "--gpus", "8", "--gpu", "h100", "--layout",
                 "parallel.dp_shard=8,parallel.ac=full,parallel.reshard_after_forward=true,train.micro_batch_size=1",
                 *[f"--set={s}" for s in SMALL], "--rehearse"])
    out = capsys.readouterr().out
    assert code == 0
    assert "rehearsal:" in out and "predicted" in out and "rehearsed" in out and "reduce_scatter_base" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rehearsal.json"]
    data = json.loads((tmp_path / "rehearsal.json").read_text())
    assert data["world_size"] == 8 and abs(data["ranks"][0]["error"]) <= AGREEMENT
    assert data["usable_bytes"] == pytest.approx((get_hardware("h100").memory_bytes - 3e9) * 0.95)


def test_forja_train_rehearse_needs_a_world_size(capsys):
    assert main(["train", "llama3-1b", "--rehearse"]) == 2
    assert "--world" in capsys.readouterr().err


@pytest.mark.parametrize("rank", [0, 63])
def test_experts_fewer_than_the_ranks_sharing_them_are_split_by_rows(rank):
    """Mixtral's 8 experts under EP 8 on 64 ranks: one expert a rank, shared by 8 ranks. FSDP
    split on the experts' dim would leave rank 0 a whole expert and the others none (a rehearsal
    of Mixtral 8x7B found 21 GiB of parameters where 2.8 GiB were predicted)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from forja.parallel import ParallelDims
    from forja.train.build import build_model_parts
    from forja.train.rehearse.run import fake_world

    cfg = load_config("llama3-1b", ["model.family=mixtral", "model.flavor=debug", "parallel.dp_shard=64",
                                    "parallel.ep=8"])
    args = run_model_args(cfg.model, cfg.data.vocab_size)
    with fake_world(rank, 64):
        dims = ParallelDims.from_config(cfg.parallel, 64)
        dims.build_mesh("cpu")
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        built = build_model_parts(args, dims, cfg.parallel, device=torch.device("cpu"), seed=0,
                                  load_weights=lambda part: None, seq_len=1024, float8=cfg.train.float8,
                                  materialize_in=lambda: fake)
        experts = [p for n, p in built.parts[0].named_parameters() if ".experts." in n]
        assert experts and all(p.to_local().numel() * 64 == p.numel() for p in experts)
