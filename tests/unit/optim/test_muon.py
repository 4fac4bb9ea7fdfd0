"""Muon: against torch.optim.Muon, against the formulas, the Muon/AdamW split, 3-D experts."""

from __future__ import annotations

import math

import pytest
import torch

from forja.models import build_model
from forja.optim import build_optimizer, build_scheduler, lr_multiplier
from forja.optim.config import MuonConfig, OptimConfig, ScheduleConfig
from forja.optim.muon import POLAR_EXPRESS, Muon, newton_schulz
from forja.optim.params import muon_split

COEFFS = (3.4445, -4.775, 2.0315)
SHAPES = [(32, 16), (16, 48), (24, 24)]  # tall, wide, square


def _params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _run(opt: torch.optim.Optimizer, params, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in torch 2.12/2.13")
@pytest.mark.parametrize(("scale", "adjust_lr_fn"), [("rms_match", "match_rms_adamw"), ("spectral", "original")])
def test_matches_torch_muon(scale, adjust_lr_fn):
    # torch runs Newton-Schulz in bf16 everywhere (with eps 1e-7 on the norm): so does forja here.
    ours, theirs = _params(SHAPES), _params(SHAPES)
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients=COEFFS)
    _run(Muon(ours, update_scale=scale, ns_dtype=torch.bfloat16, **settings), ours, steps=4)
    _run(torch.optim.Muon(theirs, adjust_lr_fn=adjust_lr_fn, eps=1e-7, **settings), theirs, steps=4)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    print(f"forja Muon vs torch.optim.Muon ({scale}): max |param diff| after 4 steps = {diff:.2e}")
    assert diff < 1e-6


def _reference_step(w, g, buf, *, lr, wd, momentum, nesterov, steps, scale):
    """One Muon step from the formulas, in float64, NS on the explicit wide orientation."""
    buf = momentum * buf + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * buf if nesterov else buf
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / max(x.norm().item(), 1e-7)
    a, b, c = COEFFS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    o = x.T if u.shape[0] > u.shape[1] else x
    m, n = w.shape
    factor = {"rms_match": 0.2 * math.sqrt(max(m, n)), "spectral": math.sqrt(max(1, m / n)), "none": 1.0}[scale]
    return w * (1 - lr * wd) - lr * factor * o, buf


@pytest.mark.parametrize("scale", ["rms_match", "spectral", "none"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_the_formulas(scale, nesterov):
    params = _params(SHAPES)
    ref = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(r) for r in ref]
    opt = Muon(params, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, update_scale=scale,
               ns_dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen)
            ref[i], bufs[i] = _reference_step(ref[i], p.grad.double(), bufs[i], lr=0.02, wd=0.1, momentum=0.9,
                                              nesterov=nesterov, steps=5, scale=scale)
        opt.step()
    diff = max((p.double() - r).abs().max().item() for p, r in zip(params, ref))
    assert diff < 1e-5, diff


def test_newton_schulz_drives_singular_values_near_one():
    u = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(u, COEFFS, 5, torch.float32))
    assert s.min() > 0.5 and s.max() < 1.3  # quintic NS: a band around 1, not exactly 1


def test_polar_express_brings_small_singular_values_closer_to_one_in_as_many_steps():
    """A gradient of widely spread singular values (1 to 1e-3 of the largest, as momentum makes):
    Polar Express's per-step quintics leave them in a tighter band around 1 than the fixed
    quintic does in 5 steps, and its steps are the published ones, in order."""
    gen = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=torch.float64))
    u = (q1[:, :32] * torch.logspace(0, -3, 32, dtype=torch.float64)) @ q2.T  # (64, 32)
    fixed = torch.linalg.svdvals(newton_schulz(u, COEFFS, 5, torch.float64))
    polar = torch.linalg.svdvals(newton_schulz(u, COEFFS, 5, torch.float64, "polar_express"))
    print(f"singular values after 5 steps: fixed quintic {fixed.min():.3f}-{fixed.max():.3f}, "
          f"Polar Express {polar.min():.3f}-{polar.max():.3f}")
    assert (polar - 1).abs().max() < (fixed - 1).abs().max()
    # One step by hand from the formula: X / (1.02 ||X||), then the first published (a, b, c).
    x = u.T / (1.02 * u.norm())
    a, b, c = POLAR_EXPRESS[0]
    gram = x @ x.T
    by_hand = (a * x + (b * gram + c * gram @ gram) @ x).T
    assert torch.allclose(newton_schulz(u, COEFFS, 1, torch.float64, "polar_express"), by_hand, atol=1e-12)


def test_cautious_weight_decay_decays_only_where_the_update_agrees():
    """One step's decay: a weight decays exactly where its orthogonalized update has its sign,
    and is left alone elsewhere; the update itself is applied everywhere."""
    w = torch.tensor([[1.0, -1.0], [2.0, -2.0]])
    ortho = torch.tensor([[0.5, 0.5], [-0.5, -0.5]])  # agrees at (0, 0) and (1, 1)
    param = torch.nn.Parameter(w.clone())
    opt = Muon([param], lr=0.1, weight_decay=0.5, update_scale="none", cautious_weight_decay=True)
    with torch.no_grad():
        opt._apply(param, opt.param_groups[0], ortho)
    decayed = w * torch.tensor([[1 - 0.05, 1.0], [1.0, 1 - 0.05]])
    assert torch.equal(param.detach(), decayed - 0.1 * ortho)


def test_3d_experts_are_orthogonalized_one_by_one():
    stacked, = _params([(4, 24, 16)])
    single = _params([(24, 16)] * 4)
    with torch.no_grad():
        for e, p in enumerate(single):
            p.copy_(stacked[e])
    gen = torch.Generator().manual_seed(5)
    grads = torch.randn(2, 4, 24, 16, generator=gen)
    opt_stacked, opt_single = Muon([stacked], ns_dtype=torch.float32), Muon(single, ns_dtype=torch.float32)
    for step in range(2):
        stacked.grad = grads[step].clone()
        for e, p in enumerate(single):
            p.grad = grads[step, e].clone()
        opt_stacked.step()
        opt_single.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in single]), atol=1e-6, rtol=1e-5)


def test_split_rule_on_the_debug_llama():
    split = muon_split(build_model("llama", "debug", tie_embeddings=False), OptimConfig(name="muon"))
    assert "tok_embeddings.weight" in split["adamw"] and "output.weight" in split["adamw"]
    assert "norm.weight" in split["adamw"] and "layers.0.attention_norm.weight" in split["adamw"]
    assert set(split["muon"]) == {f"layers.{i}.{m}.weight" for i in range(4) for m in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}


def test_patterns_override_the_rule():
    muon = MuonConfig(adamw_patterns=["*.attention.wo.weight"], muon_patterns=["output.weight"])
    split = muon_split(build_model("llama", "debug", tie_embeddings=False), OptimConfig(name="muon", muon=muon))
    assert "output.weight" in split["muon"] and "layers.2.attention.wo.weight" in split["adamw"]


def test_moe_router_to_adamw_and_stacked_experts_to_muon():
    split = muon_split(build_model("qwen3", "debug-moe"), OptimConfig(name="muon"))
    assert "layers.1.feed_forward.router.gate.weight" in split["adamw"]
    assert "layers.1.feed_forward.experts.w1" in split["muon"]


def test_registry_builds_one_optimizer_with_flagged_groups_and_a_schedule():
    model = build_model("llama", "debug")
    cfg = OptimConfig(name="muon", lr=0.02, weight_decay=0.1, muon=MuonConfig(adamw_lr=0.003))
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, Muon)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["muon"]["use_muon"] and by_name["muon"]["lr"] == 0.02
    assert not by_name["matrices"]["use_muon"] and by_name["matrices"]["lr"] == 0.003
    assert by_name["vectors"]["weight_decay"] == 0.0
    schedule = ScheduleConfig(warmup_steps=2, name="constant")
    sched = build_scheduler(opt, schedule, total_steps=10)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    factor = lr_multiplier(schedule, 10)(1)  # the schedule scales each group from its own initial lr
    assert by_name["muon"]["lr"] == pytest.approx(0.02 * factor) and factor < 1
    assert by_name["matrices"]["lr"] == pytest.approx(0.003 * factor)
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}


def test_ns_dtype_bf16_orthogonalizes_in_bfloat16_to_the_same_band():
    """optim.muon.ns_dtype: "auto" keeps fp32 on a CPU; "bf16" computes the iteration in bf16
    (faster on CPUs with bf16 matrix units) and still lands the singular values in the band."""
    model = build_model("llama", "debug")
    assert build_optimizer(model, OptimConfig(name="muon")).ns_dtype is None  # auto: fp32 here
    opt = build_optimizer(model, OptimConfig(name="muon", muon=MuonConfig(ns_dtype="bf16")))
    assert opt.ns_dtype == torch.bfloat16
    u = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    low, high = newton_schulz(u, COEFFS, 5, torch.bfloat16), newton_schulz(u, COEFFS, 5, torch.float32)
    assert low.dtype == torch.float32 and not torch.equal(low, high)  # computed in bf16, returned in u's dtype
    s = torch.linalg.svdvals(low)
    assert s.min() > 0.5 and s.max() < 1.3
