"""Optimizers (decay on matrices only) and learning-rate schedules."""

import math

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model
from forja.optim import build_optimizer, build_scheduler, lr_multiplier, param_groups
from forja.optim.config import OptimConfig, ScheduleConfig
from forja.optim.schedules import reapply


def test_weight_decay_only_on_matrices_and_tied_weights_once():
    model = build_model("gpt2", "debug")  # tied embeddings, biases, LayerNorms
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids))


def test_adamw_decays_a_matrix_but_not_a_norm():
    model = build_model("llama", "debug")
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    norm_before = model.norm.weight.detach().clone()
    wq_before = model.layers["0"].attention.wq.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: only weight decay can move a weight
    opt.step()
    assert torch.equal(model.norm.weight, norm_before)
    torch.testing.assert_close(model.layers["0"].attention.wq.weight, wq_before * (1 - 0.1 * 0.5))


def test_unknown_optimizer_is_named():
    with pytest.raises(ForjaError, match="optim.name = 'lamb' is not known; choose one of adamw, adam, sgd"):
        build_optimizer(build_model("llama", "debug"), OptimConfig(name="lamb"))


def _curve(name, total=100, **kw):
    f = lr_multiplier(ScheduleConfig(name=name, warmup_steps=10, min_lr_ratio=0.1, **kw), total)
    return [f(s) for s in range(total)]


def test_warmup_is_linear_and_never_zero():
    c = _curve("cosine")
    assert c[0] == pytest.approx(1 / 11) and c[9] == pytest.approx(10 / 11)
    assert all(b > a for a, b in zip(c[:10], c[1:11]))


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_decays_end_at_the_floor(name):
    c = _curve(name)
    assert c[10] == 1.0 and c[-1] == pytest.approx(0.1)  # the peak right after warmup, the floor at the end
    assert all(b < a for a, b in zip(c[10:], c[11:]))
    mid = c[55]
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)) if name == "cosine" else 1 - 0.9 * 45 / 89
    assert mid == pytest.approx(expected)


def test_wsd_holds_then_decays_over_the_last_fraction():
    c = _curve("wsd", decay_fraction=0.2)
    assert all(v == 1.0 for v in c[10:81])  # decay spans steps 80..99: 80 is its start
    assert c[81] < 1.0 and c[-1] == pytest.approx(0.1)
    assert _curve("constant")[10:] == [1.0] * 90


def test_scheduler_state_resumes_on_a_stretched_schedule():
    model = build_model("llama", "debug")
    opt = build_optimizer(model, OptimConfig(lr=1.0))
    sched = build_scheduler(opt, ScheduleConfig(warmup_steps=0), 100)
    for _ in range(30):
        opt.step()
        sched.step()
    state = sched.state_dict()
    longer = build_scheduler(opt, ScheduleConfig(warmup_steps=0), 200)
    longer.load_state_dict(state)
    reapply(longer)
    assert longer.last_epoch == 30
    assert opt.param_groups[0]["lr"] == longer.get_last_lr()[0]
    assert longer.get_last_lr()[0] == pytest.approx(lr_multiplier(ScheduleConfig(warmup_steps=0), 200)(30))
