"""QK-clip (MuonClip): the recomputed max logits against the masked scores, the clip on MHA,
GQA and MLA (heads above tau fall to tau, the others are untouched), and the step engine's
attn/ metrics and clip, through to metrics.jsonl."""

from __future__ import annotations

import pytest
import torch

from forja.errors import ForjaError
from forja.models import model_args
from forja.models.common import max_logit
from forja.models.common.attention import Attention, AttentionMask, _flex_block_mask, build_mask
from forja.models.common.mla import MLA
from forja.models.common.rope import rope_cos_sin, rope_frequencies
from forja.models.common.step_context import StepContext, share_context
from forja.optim import OptimizerGroup, SchedulerGroup
from forja.optim.config import OptimConfig, ScheduleConfig
from forja.optim.qk_clip import clip_factors, row_factors, scale_rows
from forja.parallel import ParallelConfig, ParallelDims
from forja.train.build import build_model_parts
from forja.train.step.attention_logits import head_rows
from forja.train.step.build import build_engine
from tests.integration.conftest import (
    read_metrics,
    train_args,
    train_data,  # noqa: F401  (the shared prepared corpus)
)

B, T, D = 2, 24, 64


def _inputs(head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen)
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])  # two documents in the first row
    rope = rope_cos_sin(rope_frequencies(head_dim, 10_000.0), torch.arange(T))
    return x, docs, rope


def _module(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mla":
        mla = MLA(D, 4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, softmax_scale=24**-0.5)
        with torch.no_grad():  # the latent norms' gains are left for init_weights: set them here
            mla.q_norm.weight.fill_(1.0)
            mla.kv_norm.weight.fill_(1.0)
        return mla
    return Attention(D, 4, 4 if kind == "mha" else 2, 16, bias=kind == "mha")


def _forward_max(module, x, docs, rope, window=None) -> torch.Tensor:
    module.train()
    module.step_context = StepContext(track_max_logit=True)
    mask = build_mask(docs, q_len=T, kv_len=T, window=window)
    module(x, rope, mask)
    return module.take_max_logit()


def test_max_logits_match_the_masked_scores(monkeypatch):
    monkeypatch.setattr(max_logit, "MAX_LOGIT_CHUNK", 4 * 4 * T * 5)  # 5 queries a chunk: several chunks
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, 4, T, 8, generator=gen) * 3, torch.randn(B, 2, T, 8, generator=gen) * 3
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    for mask, dense in [(build_mask(None, q_len=T, kv_len=T), torch.ones(T, T).tril().bool()[None, None]),
                        (build_mask(docs, q_len=T, kv_len=T, window=6), None)]:
        if dense is None:
            dense = mask.dense
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.5  # (B, H, T, T)
        expected = scores.masked_fill(~dense, -torch.inf).amax(dim=(0, 2, 3))
        got = max_logit.max_logits(q, k, mask, 0.5)
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    # FlexAttention's block mask (CUDA's path) is read through its mask_mod: the same maxima.
    flex = AttentionMask(block_mask=_flex_block_mask(docs, T, 6, torch.device("cpu")))
    assert torch.equal(max_logit.max_logits(q, k, flex, 0.5), got)


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_clip_brings_heads_above_tau_to_tau_and_leaves_the_others(kind):
    module = _module(kind)
    x, docs, rope = _inputs(16 if kind != "mla" else 8)
    with torch.no_grad():  # head 1's queries 4x: its logits well above the others'
        q = module.wq if kind != "mla" else module.wq_b
        width = q.weight.shape[0] // 4
        q.weight[width:2 * width] *= 4
    before = _forward_max(module, x, docs, rope, window=8 if kind == "gqa" else None)  # (H,)
    tau = float(before.sort().values[1:3].mean())  # two heads above, two below
    above = before > tau
    assert above.sum() == 2
    weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    gamma = clip_factors(before, tau)
    for tensor, segments in head_rows(module):
        scale_rows(tensor, row_factors(gamma, segments))
    after = _forward_max(module, x, docs, rope, window=8 if kind == "gqa" else None)
    print(f"{kind}: max logits {before.tolist()} -> {after.tolist()} (tau {tau:.3f})")
    assert torch.allclose(after[above], torch.full_like(after[above], tau), rtol=1e-5)
    assert torch.equal(after[~above], before[~above])
    for name, p in module.named_parameters():  # rows of heads below tau: untouched, bit for bit
        old = weights[name]
        if not torch.equal(p, old):
            assert name in {"wq.weight", "wk.weight", "wq.bias", "wk.bias", "wq_b.weight", "wkv_b.weight"}
            rows = p.shape[0] // 4
            for h in range(4):
                block = slice(h * rows, (h + 1) * rows)
                assert torch.equal(p[block], old[block]) == (not above[h])
    if kind == "gqa":  # the key heads are shared: left alone, the queries take the whole factor
        assert torch.equal(module.wk.weight, weights["wk.weight"])
    if kind == "mla":  # the shared rotary key (in wkv_a) and the values are not scaled
        assert torch.equal(module.wkv_a.weight, weights["wkv_a.weight"])
        v_rows = module.wkv_b.weight.view(4, 16 + 16, -1)[:, 16:]
        assert torch.equal(v_rows, weights["wkv_b.weight"].view(4, 32, -1)[:, 16:])


def test_validation_and_no_tracking_in_eval():
    with pytest.raises(ForjaError, match="optim.qk_clip_tau"):
        OptimConfig(qk_clip_tau=-1.0)
    module = _module("mha")
    x, docs, rope = _inputs(16)
    module.step_context = StepContext(track_max_logit=True)
    module.eval()
    module(x, rope, build_mask(docs, q_len=T, kv_len=T))
    assert module.take_max_logit() is None  # validation forwards do not count


def test_a_train_run_logs_the_max_logit_and_clips(tmp_path, train_data):  # noqa: F811
    from forja.cli import main

    run = tmp_path / "run"
    changes = {"train.steps": "3", "train.val_interval": "0", "train.sample_tokens": "0",
               "checkpoint.interval": "0", "optim.qk_clip_tau": "0.1"}
    assert main(train_args(run, train_data, **changes)) == 0
    rows = [r for r in read_metrics(run) if "attn/max_logit" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    layers = sorted(k for k in rows[0] if k.startswith("attn/layer"))
    assert layers and all(k.endswith("/max_logit") for k in layers)
    assert rows[0]["attn/max_logit"] == pytest.approx(max(rows[0][k] for k in layers))
    # A fresh debug model's logits are about 0.2: tau 0.1 clips heads, and the next step sees lower ones.
    assert rows[0]["attn/max_logit"] > 0.1 and rows[0]["attn/clipped_heads"] > 0
    assert rows[1]["attn/max_logit"] < rows[0]["attn/max_logit"]


def test_after_an_engine_step_with_a_tiny_tau_the_next_forward_stays_below_it(dims):
    from tests.unit.train.step.test_engine import _batches

    parts = build_model_parts(model_args("llama", "debug", n_layers=2), dims, ParallelConfig(),
                              device=torch.device("cpu"), seed=0).parts
    # lr 1e-12: the weights move by the clip alone, so the next forward on the same batch is exact.
    optimizers = OptimizerGroup(parts, OptimConfig(name="sgd", lr=1e-12, qk_clip_tau=0.05))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0), 10)
    engine = build_engine(parts, None, optimizers, scheduler, dims, device=torch.device("cpu"), precision="fp32",
                          grad_clip=1.0, document_mask=True)
    batches = _batches()
    first = engine.train_step(batches).metrics
    assert first["attn/max_logit"] > 0.05 and first["attn/clipped_heads"] > 0
    assert set(first) >= {"attn/layer0/max_logit", "attn/layer1/max_logit"}
    second = engine.train_step(batches).metrics
    print(f"max logit {first['attn/max_logit']:.4f} -> {second['attn/max_logit']:.4f} (tau 0.05)")
    # The first layer sees the same input: exact. Later layers see inputs that the earlier layers'
    # clip changed a little (measured 0.5% over tau), as in the paper: a clip per step, not a bound.
    assert second["attn/layer0/max_logit"] <= 0.05 * (1 + 1e-5)
    assert second["attn/max_logit"] <= 0.05 * 1.02
    assert engine.train_step(batches).metrics["attn/max_logit"] <= 0.05 * (1 + 1e-5)  # one more clip: exact


def test_qk_norm_layers_are_measured_but_not_clipped_and_the_fallback_says_so():
    from forja import fallbacks
    from forja.models import build_from_args
    from forja.train.step.attention_logits import AttentionLogits
    from forja.train.step.hooks import ReduceGroups, StepDone, Tally

    fallbacks.clear()
    model = build_from_args(model_args("qwen3", "debug"), device="cpu")  # QK-norm in every layer
    dims = ParallelDims.from_config(ParallelConfig(), 1)
    logits = AttentionLogits([model], dims, OptimConfig(qk_clip_tau=1e-3))
    share_context(model, StepContext(track_max_logit=logits.enabled))  # as the engine does
    assert all(head_rows(m) is None and m.track_max_logit for _, m in logits.layers)
    assert [f.key for f in fallbacks.recorded()] == ["optim.qk_clip"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    model(torch.randint(0, 100, (1, 16)))
    tally = Tally()  # the engine's round after a step: record, reduce (one process: nothing to do), fetch
    logits.record(tally)
    tally.reduce(ReduceGroups.alone())
    tally.fetch()
    metrics = logits.end(StepDone(stepped=True))
    assert metrics["attn/max_logit"] > 1e-3 and metrics["attn/clipped_heads"] == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    fallbacks.clear()
