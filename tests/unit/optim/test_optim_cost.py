"""Optimizers at their documented cost: SOAP preconditions only the hidden matrices (embeddings,
output, routers and vectors take AdamW, as under Muon), no factor is larger than
max_precond_dim, every registered optimizer trains, and bench/optim_cost.py's measurement runs
(its timings are the bench's business, not asserted here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model
from forja.names import named_unique_parameters
from forja.optim import build_optimizer
from forja.optim.config import DEFAULT_LR, OptimConfig, SoapConfig
from forja.optim.optimizers import OPTIMIZERS
from forja.optim.params import soap_param_groups

sys.path.append(str(Path(__file__).resolve().parents[3] / "bench"))  # last: bench/ must not shadow packages
import optim_cost  # noqa: E402

HIDDEN = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
          "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def _names_by_group(model, groups) -> dict[str, set[str]]:
    names = {id(p): n for n, p in named_unique_parameters(model)}
    return {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}


def _one_step(model, cfg: OptimConfig) -> torch.optim.Optimizer:
    opt = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_soap_preconditions_the_hidden_matrices_and_leaves_the_rest_to_adamw():
    model = build_model("llama", "debug", tie_embeddings=False)
    groups = _names_by_group(model, soap_param_groups(model, OptimConfig(name="soap")))
    assert groups["soap"] == {f"layers.{i}.{m}.weight" for i in range(4) for m in HIDDEN}
    assert groups["matrices"] == {"tok_embeddings.weight", "output.weight"}
    assert "norm.weight" in groups["vectors"]
    small = build_model("llama", "debug", tie_embeddings=False, n_layers=1)  # one layer: few eighs
    opt = _one_step(small, OptimConfig(name="soap"))
    # The embedding took the plain Adam step: two moments of its own shape, no factor.
    assert set(opt.state[small.tok_embeddings.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert {"L", "R"} <= set(opt.state[small.layers["0"].attention.wq.weight])


def test_soap_leaves_a_moe_router_to_adamw():
    model = build_model("qwen3", "debug-moe")
    groups = _names_by_group(model, soap_param_groups(model, OptimConfig(name="soap")))
    assert "layers.1.feed_forward.router.gate.weight" in groups["matrices"]
    assert "layers.1.feed_forward.experts.w1" in groups["soap"]


def test_no_factor_is_larger_than_max_precond_dim():
    # 200: w1 (384 x 128) keeps only its 128-side factor; the output (2048 x 128), sent to SOAP
    # by its pattern, likewise; wq (128 x 128) keeps both.
    model = build_model("llama", "debug", tie_embeddings=False, n_layers=1)
    cfg = OptimConfig(name="soap", soap=SoapConfig(max_precond_dim=200, soap_patterns=["output.weight"]))
    opt = _one_step(model, cfg)
    for state in opt.state.values():
        for key in ("L", "R", "Q_L", "Q_R"):
            assert key not in state or max(state[key].shape) <= 200
    w1, out = opt.state[model.layers["0"].feed_forward.w1.weight], opt.state[model.output.weight]
    assert "L" not in w1 and w1["R"].shape == (128, 128)
    assert "L" not in out and out["R"].shape == (128, 128)
    assert {"L", "R"} <= set(opt.state[model.layers["0"].attention.wq.weight])


def test_adamw_patterns_take_a_matrix_off_soap():
    model = build_model("llama", "debug")
    cfg = OptimConfig(name="soap", soap=SoapConfig(adamw_patterns=["*.attention.wo.weight"]))
    groups = _names_by_group(model, soap_param_groups(model, cfg))
    assert "layers.2.attention.wo.weight" in groups["matrices"]
    assert "layers.2.attention.wq.weight" in groups["soap"]


@pytest.mark.parametrize("key, value", [("max_precond_dim", 0), ("precondition_frequency", 0),
                                        ("shampoo_beta", 1.0)])
def test_a_bad_soap_value_names_its_key(key, value):
    with pytest.raises(ForjaError, match=f"optim.soap.{key} = {value} must be"):
        SoapConfig(**{key: value})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_trains_two_steps_of_a_tiny_model(name):
    torch.manual_seed(0)
    model = build_model("llama", "debug", n_layers=1, vocab_size=256)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(name=name, lr=DEFAULT_LR[name]))
    tokens = torch.randint(0, 256, (2, 17))
    losses = []
    for _ in range(2):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters()), name


def test_the_cost_bench_measures_every_optimizer_against_adamw():
    tokens = torch.randint(0, 256, (2, 17))
    names = ["adamw", *(n for n in OPTIMIZERS if n != "adamw")]
    configs = {n: OptimConfig(name=n, lr=DEFAULT_LR[n]) for n in names}
    costs = optim_cost.measure(lambda: build_model("llama", "debug", n_layers=1, vocab_size=256), configs, 3, tokens)
    assert list(costs) == names
    assert all(len(c.whole) == len(c.opt) == 3 and c.state_bytes > 0 for c in costs.values())
    # AdamW holds two fp32 moments per parameter; SGD's momentum one.
    params = build_model("llama", "debug", n_layers=1, vocab_size=256).num_params()
    assert costs["adamw"].state_bytes == pytest.approx(8 * params, abs=1024)
    assert costs["sgd"].state_bytes == pytest.approx(4 * params, abs=1024)
    lines = optim_cost.table(costs).splitlines()
    assert len(lines) == 2 + len(names) and lines[2].startswith("| adamw |") and "| 1.00x |" in lines[2]
