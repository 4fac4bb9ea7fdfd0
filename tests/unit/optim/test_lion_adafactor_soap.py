"""Lion, Adafactor and SOAP: updates against references written from the papers' formulas,
state that resumes bit for bit, weight decay on matrices only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from forja.errors import ForjaError
from forja.models import build_model
from forja.optim import build_optimizer
from forja.optim.config import AdafactorConfig, LionConfig, OptimConfig, SoapConfig


class Tiny(nn.Module):
    """Square matrices (a full-rank G G^T from step 1, so SOAP's eigenbases are well defined
    whatever the rounding), a 3-D weight, a wide matrix and vectors."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(6, 6, generator=g))
        self.cube = nn.Parameter(torch.randn(2, 3, 6, generator=g))  # SOAP: viewed as (6, 6)
        self.wide = nn.Parameter(torch.randn(5, 12, generator=g))
        self.bias = nn.Parameter(torch.randn(6, generator=g))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        _grads(model, s)
        opt.step()


# ---- references, one parameter at a time, from the papers' formulas --------------------------

def _lion_ref(p, grads, lr, b1, b2, wd):
    m = torch.zeros_like(p)
    for g in grads:
        update = torch.sign(b1 * m + (1 - b1) * g)
        p = p - lr * (update + wd * p)
        m = b2 * m + (1 - b2) * g
    return p


def _adam_ref(p, grads, lr, b1, b2, eps, wd):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * ((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p)
    return p


def _eig_desc(a):
    return torch.linalg.eigh(a)[1].flip(1)


def _soap_ref(p, grads, lr, b1, b2, eps, wd, sb, freq, max_dim):
    """Algorithm 3 of Vyas et al. 2024: identity bases for step 1; after each step, the factors,
    then every `freq` steps from step 1 the bases (eigh first, then one sorted power iteration + QR)."""
    shape = p.shape
    w = p.reshape(-1, shape[-1])
    rows, cols = w.shape
    left, right = rows <= max_dim, cols <= max_dim
    L, R = torch.zeros(rows, rows), torch.zeros(cols, cols)
    QL, QR = torch.eye(rows), torch.eye(cols)
    M, V = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        g = g.reshape(rows, cols)
        ql, qr = (QL if left else torch.eye(rows)), (QR if right else torch.eye(cols))
        M = b1 * M + (1 - b1) * g
        g_rot = ql.T @ g @ qr
        V = b2 * V + (1 - b2) * g_rot * g_rot
        n_rot = (ql.T @ M @ qr / (1 - b1**t)) / ((V / (1 - b2**t)).sqrt() + eps)
        w = w - lr * (ql @ n_rot @ qr.T + wd * w)
        # sb * L + (1 - sb) * G G^T, rounded as the optimizer rounds it: an eigenvector of a factor
        # with close eigenvalues (one step's G G^T has some) moves a lot with the last bit of
        # the factor, and that would test eigh's conditioning rather than the update.
        L = torch.lerp(L, g @ g.T, 1 - sb)
        R = torch.lerp(R, g.T @ g, 1 - sb)
        if (t - 1) % freq == 0:
            if t == 1:
                QL, QR = _eig_desc(L), _eig_desc(R)
            else:
                order_l = torch.argsort(torch.diag(QL.T @ L @ QL), descending=True, stable=True)
                order_r = torch.argsort(torch.diag(QR.T @ R @ QR), descending=True, stable=True)
                QL = torch.linalg.qr(L @ QL[:, order_l])[0]
                QR = torch.linalg.qr(R @ QR[:, order_r])[0]
                V = V[order_l if left else slice(None)][:, order_r if right else slice(None)]
    return w.reshape(shape)


def _references(name: str, model: Tiny, steps: int, cfg: OptimConfig) -> dict[str, torch.Tensor]:
    grads = {n: [] for n, _ in model.named_parameters()}
    for s in range(steps):
        _grads(model, s)
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    out = {}
    for n, p in model.named_parameters():
        p0, wd = p.detach().clone(), (cfg.weight_decay if p.dim() >= 2 else 0.0)
        b1, b2 = cfg.betas
        if name == "lion":
            out[n] = _lion_ref(p0, grads[n], cfg.lr, *cfg.lion.betas, wd)
        elif p.dim() < 2:
            out[n] = _adam_ref(p0, grads[n], cfg.lr, b1, b2, cfg.eps, wd)
        else:
            s = cfg.soap
            out[n] = _soap_ref(p0, grads[n], cfg.lr, b1, b2, cfg.eps, wd, s.shampoo_beta,
                               s.precondition_frequency, s.max_precond_dim)
    return out


CONFIGS = {
    "lion": OptimConfig(name="lion", lr=1e-2, weight_decay=0.1, lion=LionConfig(betas=(0.9, 0.99))),
    # max_precond_dim = 8: `wide` (5 x 12) is rotated on its left side only.
    "soap": OptimConfig(name="soap", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                        soap=SoapConfig(shampoo_beta=0.9, precondition_frequency=2, max_precond_dim=8)),
    "adafactor": OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.1,
                             adafactor=AdafactorConfig(beta2_decay=-0.7, eps2=1e-3, d=1.5)),
}


@pytest.mark.parametrize("name", ["lion", "soap"])
def test_update_matches_the_papers_formulas(name):
    model, steps = Tiny(), 7  # SOAP, frequency 2: eigh at step 1, power iterations at 3, 5, 7
    expected = _references(name, copy.deepcopy(model), steps, CONFIGS[name])
    _run(model, build_optimizer(model, CONFIGS[name]), range(steps))
    for n, p in model.named_parameters():
        err = (p.detach() - expected[n]).abs().max().item()
        assert err < 1e-6, (n, err)


def test_adafactor_is_torchs_with_the_config_options():
    cfg = CONFIGS["adafactor"]
    model, ref = Tiny(), Tiny()
    a = cfg.adafactor
    direct = torch.optim.Adafactor([{"params": [ref.w, ref.cube, ref.wide], "weight_decay": 0.1},
                                    {"params": [ref.bias], "weight_decay": 0.0}],
                                   lr=1e-2, beta2_decay=a.beta2_decay, eps=(None, a.eps2), d=a.d)
    _run(model, build_optimizer(model, cfg), range(5))
    _run(ref, direct, range(5))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() < 1e-6, n


def test_adafactor_first_step_is_the_factored_formula():
    """Step 1 (beta2 = 1 - 1^c = 0): V = row means x column means / their mean;
    p <- p (1 - lr wd) - max(eps2, RMS(p)) min(lr, 1) u / max(1, RMS(u) / d), u = g / sqrt(V)."""
    cfg = CONFIGS["adafactor"]
    model = Tiny()
    p0 = model.w.detach().clone()
    _grads(model, 0)
    g = model.w.grad.clone()
    build_optimizer(model, cfg).step()
    row, col = (g * g).mean(dim=1, keepdim=True), (g * g).mean(dim=0, keepdim=True)
    u = g / (row @ col / row.mean()).sqrt()
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    alpha = max(cfg.adafactor.eps2, rms(p0).item()) * min(cfg.lr, 1.0)
    expected = p0 * (1 - cfg.lr * 0.1) - alpha * u / max(1.0, (rms(u) / cfg.adafactor.d).item())
    assert (model.w.detach() - expected).abs().max().item() < 1e-6


@pytest.mark.parametrize("name", ["lion", "soap", "adafactor"])
def test_state_dict_round_trip_continues_bit_identically(name):
    cfg = CONFIGS[name]
    straight = Tiny()
    _run(straight, build_optimizer(straight, cfg), range(6))

    first = Tiny()
    opt = build_optimizer(first, cfg)
    _run(first, opt, range(3))
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = Tiny()
    resumed.load_state_dict(saved_model)
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(saved_opt)
    _run(resumed, opt2, range(3, 6))
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("name", ["lion", "soap", "adafactor"])
def test_weight_decay_on_matrices_only(name):
    model = build_model("llama", "debug")
    cfg = copy.deepcopy(CONFIGS[name])
    cfg.lr, cfg.weight_decay = 0.1, 0.5
    opt = build_optimizer(model, cfg)
    norm_before = model.norm.weight.detach().clone()
    wq_before = model.layers["0"].attention.wq.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: every update is 0, only weight decay moves
    opt.step()
    assert torch.equal(model.norm.weight, norm_before)
    torch.testing.assert_close(model.layers["0"].attention.wq.weight, wq_before * (1 - 0.1 * 0.5))


def test_unknown_optimizer_lists_the_new_names():
    with pytest.raises(ForjaError, match="optim.name = 'lamb' is not known") as err:
        build_optimizer(build_model("llama", "debug"), OptimConfig(name="lamb"))
    assert all(n in str(err.value) for n in ("adafactor", "lion", "soap"))


def test_adafactors_whole_tensor_update_is_torchs():
    """The update forja runs on gathered FSDP/TP shards (forja/optim/adafactor.py) against
    torch's own Adafactor, matrices, a 3-D tensor and a vector, 5 steps."""
    from forja.optim.adafactor import _update

    gen = torch.Generator().manual_seed(3)
    shapes = [(6, 4), (2, 3, 5), (7,)]
    ours = [torch.randn(s, generator=gen) for s in shapes]
    theirs = [p.clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.Adafactor(theirs, lr=1e-2, beta2_decay=-0.7, eps=(None, 1e-3), d=1.5,
                                      weight_decay=0.1, foreach=False)
    states = [{} for _ in ours]
    for _ in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch_opt.step()
        for p, g, st in zip(ours, grads, states):
            if not st:
                st.update(step=torch.tensor(0.0), **({"row_var": g.new_zeros(g.shape[:-1]).unsqueeze(-1),
                                                     "col_var": g.new_zeros(g.shape[:-2] + g.shape[-1:]).unsqueeze(-2)}
                                                    if g.dim() > 1 else {"variance": torch.zeros_like(g)}))
            _update(p, g, st, lr=1e-2, d=1.5, beta2_decay=-0.7, weight_decay=0.1, eps1=None, eps2=1e-3)
    for p, q in zip(ours, theirs):
        assert (p - q.detach()).abs().max().item() < 1e-6


@pytest.mark.parametrize("name, implementation, instead", [
    ("adafactor", "fused", "the foreach step"), ("lion", "foreach", "its own step"),
    ("soap", "fused", "its own step"), ("muon", "for-loop", "its own step")])
def test_an_implementation_the_optimizer_lacks_is_in_the_fallback_record(name, implementation, instead):
    from forja import fallbacks

    fallbacks.clear()
    build_optimizer(build_model("llama", "debug"), OptimConfig(name=name, implementation=implementation))
    (entry,) = fallbacks.recorded()
    assert (entry.key, entry.asked, entry.instead) == (
        "optim.implementation", f"optim.implementation = '{implementation}' ({name})", instead)
    fallbacks.clear()
    build_optimizer(build_model("llama", "debug"), OptimConfig(name=name))  # auto: nothing to say
    assert fallbacks.recorded() == []
