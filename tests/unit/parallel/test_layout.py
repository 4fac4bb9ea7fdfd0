"""Layouts checked before anything starts; activation checkpointing keeps parameter names."""

import dataclasses

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, model_args
from forja.parallel.ac import apply_ac
from forja.parallel.checks import LayoutRequest, check_layout, layout_errors
from forja.parallel.config import ParallelConfig
from forja.parallel.degrees import MESH_AXES, Axis, Degrees
from forja.parallel.dims import ParallelDims


def _request(world: int, seq_len: int = 64, gbs: int = 8, mbs: int = 2, model=("llama", "debug"),
             device_type: str = "cpu", **parallel) -> LayoutRequest:
    return LayoutRequest(args=model_args(*model), parallel=ParallelConfig(**parallel), world_size=world,
                         seq_len=seq_len, global_batch_size=gbs, micro_batch_size=mbs, device_type=device_type)


def _check(world: int, **kwargs):
    check_layout(_request(world, **kwargs))


def test_good_layouts_pass():
    _check(8, tp=2, pp=2)  # dp_shard fills the rest: 2
    _check(4, dp_replicate=2)
    _check(8, ep=4, tp=2, model=("qwen3", "debug-moe"))  # 8 experts over 4 of the 4 dp_shard ranks
    _check(4, grad_sync="step", reshard_after_forward=False)  # a distributed optimizer, as Megatron's
    for kind in ("ring", "all-to-all"):  # the recurrent mixers split a sequence: KDA, Mamba-2
        _check(2, cp=2, cp_kind=kind, model=("kimi_linear", "debug"))
        _check(2, cp=2, cp_kind=kind, model=("nemotron_h", "debug"))
    _check(4, cp=4, cp_kind="all-to-all", model=("nemotron_h", "debug"))  # 2 Mamba-2 groups, each on 2 ranks


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(world=4, tp=4), r"model n_kv_heads = 2 \(parallel.tp = 4\) is not divisible by 4"),
    (dict(world=2, tp=2, seq_len=63), r"train.seq_len = 63 \(parallel.tp = 2 with sequence parallelism\)"),
    (dict(world=2, cp=2, seq_len=66), r"train.seq_len = 66 \(2 x parallel.cp, a chunk and its mirror per rank = 4"),
    (dict(world=4, cp=4, cp_kind="all-to-all", seq_len=66), r"train.seq_len = 66 \(parallel.cp, a chunk per rank = 4"),
    (dict(world=8, cp=8, cp_kind="all-to-all"),
     r"model n_heads = 4 is not divisible by parallel.cp = 8: parallel.cp_kind"),
    (dict(world=8, cp=4, tp=2, cp_kind="all-to-all"),
     r"model n_heads = 4 / parallel.tp = 2 = 2 per tensor-parallel rank is not divisible by parallel.cp = 4"),
    (dict(world=2, cp=2, seq_len=8, model=("qwen3_5", "debug")), r"leaves 2 tokens per chunk, fewer than the 3"),
    (dict(world=2, cp=2, seq_len=8, model=("kimi_linear", "debug")), r"fewer than the 3 a Gated DeltaNet's or Kimi"),
    (dict(world=2, cp=2, seq_len=8, model=("nemotron_h", "debug")), r"fewer than the 3 a Mamba-2's convolution"),
    (dict(world=2, tp=2, async_tp=True), r"parallel.async_tp needs CUDA"),
    (dict(world=4, gbs=6), r"train.global_batch_size = 6 is not divisible by the data-parallel degree 4"),
    (dict(world=2, gbs=8, mbs=3), r"= 4 is not divisible by train.micro_batch_size = 3"),
    (dict(world=2, ep=2), r"parallel.ep = 2 needs a mixture-of-experts model.*set parallel.ep = 1"),
    (dict(world=3, ep=3, model=("qwen3", "debug-moe")),
     r"model n_experts = 8 \(parallel.ep = 3\) is not divisible by 3"),
    (dict(world=2, grad_sync="step"), r"grad_sync = 'step' .* set parallel.reshard_after_forward = false"),
    (dict(world=4, pp=2, grad_sync="step", reshard_after_forward=False), r"a pipeline schedule already does"),
    (dict(world=2, grad_sync="step", reshard_after_forward=False, cpu_offload=True), r"cpu_offload = true moves"),
])
def test_bad_layouts_name_the_keys(kwargs, message):
    with pytest.raises(ForjaError, match=message):
        _check(kwargs.pop("world"), **kwargs)


def test_the_validator_gives_every_reason_at_once():
    """layout_errors lists each problem (the planner shows the first, train all of them)."""
    r = _request(8, tp=4, seq_len=63, gbs=7)
    errors = layout_errors(r)
    assert len(errors) == 3, errors
    assert "n_kv_heads = 2" in errors[0] and "train.seq_len = 63" in errors[1] and "global_batch_size = 7" in errors[2]
    with pytest.raises(ForjaError, match=r"refused for 3 reasons: \(1\) model n_kv_heads"):
        check_layout(r)
    assert layout_errors(_request(2, tp=2)) == []


def test_the_validator_judges_a_gpu_layout_on_a_cpu_machine():
    """The planner asks about CUDA ranks from anywhere: device_type, not this machine's device."""
    assert layout_errors(_request(2, tp=2, async_tp=True, compile=True, device_type="cuda")) == []
    assert "needs CUDA" in layout_errors(_request(2, tp=2, async_tp=True, compile=True, device_type="cpu"))[0]


def test_context_parallelism_runs_on_any_device_with_document_masks():
    for kind in ("ring", "all-to-all"):
        for device in ("cpu", "cuda"):
            r = LayoutRequest(args=model_args("llama", "debug"), parallel=ParallelConfig(cp=2, cp_kind=kind),
                              world_size=2, seq_len=64, global_batch_size=8, micro_batch_size=2,
                              device_type=device, document_mask=True)
            assert layout_errors(r) == [], (kind, device)
    # fewer key/value heads than ranks are repeated; heads that do not split are refused
    assert layout_errors(_request(4, cp=4, cp_kind="all-to-all")) == []  # 4 heads, 2 kv heads
    assert layout_errors(_request(8, cp=8)) == []  # ring: any head count
    assert layout_errors(_request(4, cp=2, pp=2)) == []  # with a pipeline


def test_every_length_of_a_sequence_length_schedule_is_checked():
    r = LayoutRequest(args=model_args("llama", "debug"), parallel=ParallelConfig(cp=2), world_size=2, seq_len=64,
                      global_batch_size=8, micro_batch_size=2, seq_lens=(30, 64))
    assert layout_errors(r) == ["train.seq_len = 30 (2 x parallel.cp, a chunk and its mirror per rank = 4, under "
                                "parallel.cp_kind = 'ring') is not divisible by 4; change train.seq_len or parallel.cp"]
    assert layout_errors(dataclasses.replace(r, seq_lens=(32, 64))) == []


@pytest.mark.parametrize("optim", [dict(qk_clip_tau=100.0), dict(max_logit_metric=True)])
def test_attention_logits_are_refused_with_context_parallelism(optim):
    """A head's max logit is recomputed from the keys a rank holds: under cp a part of them."""
    r = dataclasses.replace(_request(2, cp=2), **optim)
    assert layout_errors(r) == ["optim.qk_clip_tau / optim.max_logit_metric cannot be used with parallel.cp > 1 "
                                "(each rank sees only part of a sequence's keys); set parallel.cp = 1 or turn them off"]
    assert layout_errors(dataclasses.replace(_request(2, dp_shard=2), **optim)) == []
    assert layout_errors(_request(2, cp=2)) == []


def test_degrees_are_one_value_with_named_axes():
    d = ParallelConfig(tp=2, pp=2).degrees
    assert d == Degrees(tp=2, pp=2, dp_shard=-1)
    resolved = d.resolve(8)
    assert (resolved[Axis.DP_SHARD], resolved.dp, resolved.world_size) == (2, 2, 8)
    assert resolved.describe() == "dp_shard 2 x tp 2 x pp 2" and Degrees().describe() == "1 rank"
    assert [str(a) for a in MESH_AXES] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    dims = ParallelDims.from_config(ParallelConfig(tp=2, pp=2), 8)
    assert dims.degrees == resolved and (dims.tp, dims.pp, dims.dp_shard, dims.dp) == (2, 2, 2, 2)
    with pytest.raises(ForjaError, match="parallel.tp = 0 must be at least 1"):
        ParallelConfig(tp=0)
    with pytest.raises(ForjaError, match=r"parallel.dp_shard = -2 must be at least 1, or -1 for the rest"):
        ParallelConfig(dp_shard=-2)


def test_degrees_must_multiply_to_the_world_size():
    with pytest.raises(ForjaError, match=r"parallel degrees multiply to 8 .* but 4 processes run"):
        ParallelDims.from_config(ParallelConfig(tp=2, pp=2, dp_shard=2), 4)
    with pytest.raises(ForjaError, match="world size 6 is not divisible by dp_replicate\\*tp\\*pp\\*cp = 4"):
        ParallelDims.from_config(ParallelConfig(tp=2, pp=2), 6)
    with pytest.raises(ForjaError, match=r"parallel.ep = 4 does not divide parallel.dp_shard = 2"):
        ParallelDims.from_config(ParallelConfig(tp=2, ep=4), 4)


@pytest.mark.parametrize("ac", [dict(ac="full"), dict(ac="selective"), dict(ac="selective", ac_every=2)])
def test_checkpointed_model_has_the_same_state_dict_and_gradients(ac):
    plain = build_model("llama", "debug", seed=1)
    wrapped = build_model("llama", "debug", seed=1)
    apply_ac(wrapped, ParallelConfig(**ac))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 2048, (2, 16))
    docs = torch.tensor([[0] * 6 + [1] * 10] * 2)
    for model in (plain, wrapped):
        model(tokens, docs).float().logsumexp(-1).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_tp_with_compile_is_allowed():
    # torch 2.13/2.14 drop the gradient of a compiled block's pending-collective input;
    # forja waits for it first (forja/parallel/tp.py), and the parity tests cover the layouts.
    _check(2, tp=2, compile=True)
    _check(4, tp=2, compile=True, dp_shard=2)


def test_tp_must_split_gated_deltanet_by_whole_key_heads():
    args = model_args("qwen3_5", "debug", n_kv_heads=4)  # attention would split 4 ways; 2 key heads will not
    r = LayoutRequest(args=args, parallel=ParallelConfig(tp=4), world_size=4, seq_len=64, global_batch_size=8,
                      micro_batch_size=2)
    assert layout_errors(r) == ["model linear_n_k_heads = 2 (parallel.tp = 4) is not divisible by 4; choose a "
                                "parallel.tp that divides it, or change the model (model.overrides)"]
    check_layout(_request(2, tp=2, model=("qwen3_5", "debug")))  # one key head and two value heads a rank
