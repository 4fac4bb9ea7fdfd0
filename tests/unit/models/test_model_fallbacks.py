"""Fallbacks decided in model code are recorded (forja/fallbacks.py): FlexAttention asked for on
a CPU, and the fused SwiGLU asked for in a mixture of experts, whose routed experts do not take it."""

from __future__ import annotations

import pytest
import torch

from forja import fallbacks
from forja.models import build_model
from forja.models.common.attention import build_mask


@pytest.fixture(autouse=True)
def empty_record():
    fallbacks.clear()
    yield
    fallbacks.clear()


def test_flex_on_cpu_is_recorded_and_sdpa_is_not():
    docs = torch.tensor([[0, 0, 1, 1]])
    build_mask(docs, q_len=4, kv_len=4, backend="sdpa")
    assert fallbacks.recorded() == []
    mask = build_mask(docs, q_len=4, kv_len=4, backend="flex")
    assert mask.dense is not None  # SDPA's mask runs instead
    assert [(f.key, f.asked, f.instead) for f in fallbacks.recorded()] == [
        ("attention.flex", 'model.attention = "flex"', "SDPA")]


def test_fused_swiglu_in_routed_experts_is_recorded_where_the_kernel_is_promised(monkeypatch):
    build_model("qwen3", "debug-moe", device="meta", fused_ops=("swiglu",))
    if not torch.cuda.is_available():  # on a CPU the references are the rule: nothing to report
        assert fallbacks.recorded() == []
    monkeypatch.setenv("FORJA_OPS", "triton")  # kernels asked for everywhere
    build_model("qwen3", "debug-moe", device="meta", fused_ops=("swiglu",))
    assert [f.key for f in fallbacks.recorded()] == ["ops.swiglu.experts"]
    fallbacks.clear()
    build_model("llama", "debug", device="meta", fused_ops=("swiglu",))  # dense: every SwiGLU fused
    assert fallbacks.recorded() == []
