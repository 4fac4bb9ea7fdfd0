"""Step hooks: the engine's one list of them, their values packed into as few collectives as
their reduce types allow, and one host sync per step, with a mixture of experts, multi-token
prediction and the max-logit metric on (the counting is reused by
tests/distributed/test_step_hooks.py, which counts the collectives of 2 ranks)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from forja.models import model_args
from forja.models.common.step_context import StepContext
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.optim.config import OptimConfig, ScheduleConfig
from forja.parallel import ParallelConfig, ParallelDims
from forja.train.build import build_model_parts
from forja.train.step.attention_logits import AttentionLogits
from forja.train.step.build import build_engine
from forja.train.step.experts import ExpertBalance
from forja.train.step.hooks import Reduce, ReduceGroups, StepShare, Tally
from forja.train.step.mtp import MTPLosses
from forja.train.step.scaler import LossScaler, LossScaling

# DeepSeek-V3's shape, tiny: latent attention, a dense block then MoE blocks, one MTP depth.
TINY_MOE = dict(dim=64, n_layers=3, n_heads=4, ffn_dim=128, vocab_size=256, max_seq_len=64, q_lora_rank=32,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=4, top_k=2,
                moe_ffn_dim=32, n_shared_experts=1, n_expert_groups=1, topk_groups=1, aux_loss_weight=0.01,
                z_loss_weight=0.001, expert_bias=True, bias_update_rate=0.001, mtp_depth=1)


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor


def batches(n: int = 2, rows: slice = slice(0, 2), vocab: int = 256, seed: int = 0) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (2, 25), generator=gen)[rows]
        docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])[rows]
        out.append(Batch(t[:, :-1], t[:, 1:], docs))
    return out


def engine(dims: ParallelDims, parallel: ParallelConfig | None = None, *, moe: bool = True, fp16: bool = False):
    """MoE + MTP + the max-logit metric (DeepSeek-V3, tiny), or a dense Llama without extras."""
    args = model_args("deepseek_v3", "debug", **TINY_MOE) if moe else model_args("llama", "debug", n_layers=2,
                                                                                  vocab_size=256)
    built = build_model_parts(args, dims, parallel or ParallelConfig(), device=torch.device("cpu"), seed=0,
                              seq_len=24)
    optimizers = OptimizerGroup(built.parts, OptimConfig(lr=3e-3, max_logit_metric=moe))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0), 10)
    return build_engine(built.parts, built.pipeline, optimizers, scheduler, dims, precision="fp16" if fp16 else "fp32",
                        device=torch.device("cpu"), grad_clip=1.0, document_mask=True,
                        scaler=LossScaler(init_scale=1024.0) if fp16 else None)


class HostSyncs(TorchDispatchMode):
    """Counts what makes the host wait for the device: a tensor read as a Python number
    (aten._local_scalar_dense: item, float, int, bool) and every tolist, cpu and numpy (on a GPU
    each copies to the host). The model's forward and backward and the optimizer's own step are
    left out (`paused`): what is counted is the step's bookkeeping."""

    def __init__(self):
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


def counted_step(step_engine, monkeypatch, step_batches) -> tuple[int, int, dict]:
    """One train_step of `step_engine`: (host syncs, collectives, metrics). Collectives are the
    step's own torch.distributed calls (FSDP's and the model's go through other functions)."""
    syncs, collectives = HostSyncs(), []
    for name in ("tolist", "cpu", "numpy"):
        method = getattr(torch.Tensor, name)

        def counting(self, *a, _method=method, **k):
            syncs.count += not syncs.paused
            return _method(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    for name in ("all_reduce", "all_gather_object", "all_gather", "broadcast", "broadcast_object_list"):
        call = getattr(dist, name)

        def counting_collective(*a, _call=call, _name=name, **k):
            if not syncs.paused:
                collectives.append(_name)
            return _call(*a, **k)
        monkeypatch.setattr(dist, name, counting_collective)
    for name in ("forward_backward", "_finish_step"):  # the model's and the optimizer's own
        method = getattr(step_engine, name)

        def paused(*a, _method=method, **k):
            with syncs.pause():
                return _method(*a, **k)
        monkeypatch.setattr(step_engine, name, paused)
    with syncs:
        out = step_engine.train_step(step_batches)
    monkeypatch.undo()
    return syncs.count, len(collectives), out.metrics


def test_an_moe_mtp_max_logit_step_syncs_with_the_host_once(dims, monkeypatch):
    moe = engine(dims)
    assert [type(h) for h in moe.hooks] == [ExpertBalance, AttentionLogits, MTPLosses]
    syncs, collectives, metrics = counted_step(moe, monkeypatch, batches())
    assert syncs == 1 and collectives == 0  # one process: nothing to reduce
    assert {"moe/load_max_mean", "moe/layer1/load_cv", "moe/layer3/aux_loss", "mtp/loss_1", "attn/max_logit",
            "attn/layer3/max_logit"} <= set(metrics)  # layer 3: the MTP block (an MoE block too)
    dense = engine(dims, moe=False)
    assert dense.hooks == [] and counted_step(dense, monkeypatch, batches(vocab=256))[:2] == (1, 0)


def test_fp16_is_a_hook_whose_scale_the_engine_owns(dims, monkeypatch):
    scaled = engine(dims, fp16=True)
    assert isinstance(scaled.hooks[-1], LossScaling) and scaled.stateful()["scaler"].scale == 1024.0
    syncs, _, metrics = counted_step(scaled, monkeypatch, batches())
    assert syncs == 1 and metrics["loss_scale"] == 1024.0 and metrics["overflow"] == 0.0
    assert engine(dims).stateful() == {}


def test_the_modules_read_the_steps_share_from_one_context(dims):
    step_engine = engine(dims, fp16=True)
    context = step_engine.step_context
    model = step_engine.model
    readers = [m for m in model.modules() if getattr(m, "step_context", None) is not None]
    assert readers and all(m.step_context is context for m in readers)
    assert context.track_max_logit and isinstance(context.aux_loss_share, torch.Tensor)
    share = StepShare(microbatches=4, loss_scale=1024.0)
    step_engine.step_context.begin_step(share.aux_loss_share)
    assert context.aux_loss_share.item() == 256.0
    with pytest.raises(TypeError, match="StepContext.for_engine"):
        StepContext().begin_step(0.5)


def test_a_tally_reduces_nothing_alone_and_brings_every_value_at_once(dims):
    tally = Tally()
    loss = tally.add(torch.tensor(2.5), Reduce.MEAN)
    table = tally.add(torch.arange(6, dtype=torch.float64).view(2, 3), Reduce.SUM, host=lambda t: t.sum(dim=1))
    hidden = tally.add(torch.ones(3), Reduce.MAX, host=False)
    kept = tally.add(torch.tensor(7.0), None)
    assert tally.reduce(ReduceGroups.of(dims)) == 0  # one process: every value is already whole
    tally.fetch()
    assert loss.host == [2.5] and table.host == [3.0, 12.0] and hidden.host == [] and kept.host == [7.0]
    assert torch.equal(table.device, torch.arange(6, dtype=torch.float64).view(2, 3))
