"""forja plan's prices of DeepSeek-V4 under pipeline and context parallelism: a stage hands on
its hc_mult streams, and under either kind of CP each block gathers what
forja/parallel/cp/compressed.py gathers, counted here from the module itself (its all-gathers
recorded, one process standing in for every rank), not worked out again by hand."""

from __future__ import annotations

import pytest
import torch

from forja.models import build_from_args, model_args
from forja.plan.context_parallel import compressed_gathers, compressed_keys
from forja.plan.hardware import get_hardware
from forja.plan.job import Job
from forja.plan.layout import Layout
from forja.plan.shape import model_shape
from forja.plan.speed import predict_time

T = 64


def _job(**overrides) -> Job:
    args = model_args("deepseek_v4", "debug", **overrides)
    return Job(shape=model_shape(args, T), seq_len=T, global_batch_size=4, gpu=True, bf16=False)


def test_a_stage_hands_on_the_streams():
    j = _job()
    assert j.shape.stage_width == 4 * 128  # hc_mult x dim
    lay = Layout.of(dp_shard=1, pp=2)
    one_stream = Job(shape=model_shape(model_args("deepseek_v4", "debug", hc_mult=1), T), seq_len=T,
                     global_batch_size=4, gpu=True, bf16=False)
    h100 = get_hardware("h100")
    assert predict_time(j, lay, h100).pp_comm == pytest.approx(4 * predict_time(one_stream, lay, h100).pp_comm)


def _recorded_gathers(kind: str, layout_kind: str, cp: int, monkeypatch) -> tuple[float, float]:
    """(elements the block's CP all-gathers, of which a gradient flows back) for one row, by the
    module's own calls: every rank's piece taken to be this rank's (the shapes are the same)."""
    from forja.models.common.attention import AttentionMask
    from forja.parallel.cp import compressed as cp_compressed
    from forja.parallel.cp.layout import SequenceLayout

    calls: list[tuple[int, bool]] = []

    def fake_all_gather(x: torch.Tensor, group) -> torch.Tensor:
        calls.append((cp * x.numel(), x.requires_grad))
        return torch.stack([x] * cp)

    monkeypatch.setattr(cp_compressed, "all_gather", fake_all_gather)
    args = model_args("deepseek_v4", "debug", layer_types=(kind,) * 4)
    model = build_from_args(args, device="cpu")
    model.init_weights(seed=0)
    attention = model.layers["0"].attention
    layout = SequenceLayout(layout_kind, cp, 1, T)  # a rank whose chunks have halos
    x = torch.randn(1, T // cp, args.dim, requires_grad=True)
    mixing = cp_compressed.CompressedMixing(layout, None, args.sliding_window)
    positions = layout.positions()
    attention(x, model.rope_tables_for(kind, positions), AttentionMask(sequence=mixing, positions=positions))
    return sum(n for n, _ in calls), sum(n for n, grad in calls if grad)


@pytest.mark.parametrize("kind", ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"])
@pytest.mark.parametrize(("layout_kind", "cp"), [("ring", 2), ("all-to-all", 2), ("ring", 4)])
def test_the_gathers_priced_are_those_the_block_makes(kind, layout_kind, cp, monkeypatch):
    j = _job(layer_types=(kind,) * 4)
    lay = Layout.of(dp_shard=1, cp=cp, cp_kind=layout_kind)
    block = j.shape.blocks[0]
    tokens_mb = T / cp  # one row a micro-batch
    gathered, summed = compressed_gathers(j, lay, block, tokens_mb)
    recorded, recorded_summed = _recorded_gathers(kind, layout_kind, cp, monkeypatch)
    # (The chunks here hold whole windows: the module's padding to the longest chunk's count adds none.)
    assert (gathered / 4, summed / 4) == (recorded, recorded_summed)  # fp32: 4 bytes an element
    # A query's scores: the window's reach before its chunk, the chunk and the entries (T + N without CP).
    chunk = T // (2 * cp if layout_kind == "ring" else cp)
    entries = T // j.args.ratio(kind) if j.args.ratio(kind) else 0
    assert compressed_keys(j, lay, block) == min(15, T - chunk) + chunk + entries
    assert compressed_keys(j, Layout(), block) == T + entries
