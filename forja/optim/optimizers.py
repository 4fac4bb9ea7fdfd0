"""Optimizers, by name (a registry: the seam where new optimizers plug in).

Weight decay goes to matrices only: decaying norm gains and biases toward zero only
hurts. A parameter is a "matrix" when it has two or more dimensions, embeddings included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forja import fallbacks
from forja.errors import ForjaError
from forja.optim.adafactor import Adafactor
from forja.optim.config import OptimConfig
from forja.optim.lion import Lion
from forja.optim.muon import Muon
from forja.optim.mup import apply_mup
from forja.optim.params import muon_param_groups, soap_param_groups
from forja.optim.soap import Soap


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (decayed) and vectors (not), named so a schedule can treat them
    apart (`schedule.groups`). Tied weights appear once."""
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields a tied weight once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "name": "matrices"},
            {"params": no_decay, "weight_decay": 0.0, "name": "vectors"}]


def _kernel_flags(cfg: OptimConfig, params: Iterable[torch.Tensor]) -> dict:
    params = list(params)
    choice = cfg.implementation
    if choice == "auto":
        # torch's fused kernels exist for CUDA and CPU (DTensors included). On CPU the fused AdamW
        # step of the default recipe's 10.5 M parameters took 9 ms against foreach's 53-69 ms.
        fused_here = all(p.device.type in ("cuda", "cpu") for p in params)
        choice = "fused" if fused_here else "foreach"
    kinds = {isinstance(p, DTensor) for p in params}
    if choice != "for-loop" and len(kinds) > 1:
        # torch's multi-tensor kernels group by device and dtype only, and refuse a group that
        # mixes DTensors with plain tensors (TP without FSDP: sharded matrices beside whole norms).
        fallbacks.record("optim.implementation", asked=f"optim.implementation = '{cfg.implementation}' "
                         f"({choice} {cfg.name})", instead="the for-loop step",
                         why="the model mixes DTensor and plain parameters (tensor parallelism without FSDP)",
                         fix="shard the rest with FSDP (parallel.dp_shard > 1) to step every parameter in one kernel")
        choice = "for-loop"
    return {"fused": choice == "fused", "foreach": choice == "foreach"} if choice != "for-loop" else \
        {"foreach": False}


def _adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    flags = _kernel_flags(cfg, (p for g in groups for p in g["params"]))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)


def _adam(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    flags = _kernel_flags(cfg, (p for g in groups for p in g["params"]))
    # Adam's weight_decay is L2 in the gradient, not decoupled: keep it off the vectors too.
    return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **flags)


def _sgd(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    flags = _kernel_flags(cfg, (p for g in groups for p in g["params"]))
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.betas[0], **flags)


def _not_offered(cfg: OptimConfig, instead: str, why: str) -> None:
    """optim.implementation asked for a kernel this optimizer does not have: the fallback record."""
    fallbacks.record("optim.implementation", asked=f"optim.implementation = '{cfg.implementation}' ({cfg.name})",
                     instead=instead, why=why, fix="leave optim.implementation = 'auto' for this optimizer")


def _adafactor(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    # torch's Adafactor has no fused kernel; its lr caps the relative step size (min(lr, 1/sqrt(t))
    # times the parameter's RMS), and its weight decay is decoupled (p *= 1 - lr * wd).
    if cfg.implementation == "fused":
        _not_offered(cfg, "the foreach step", "torch's Adafactor has no fused kernel")
    foreach = cfg.implementation in ("auto", "fused", "foreach")
    a = cfg.adafactor
    return Adafactor(groups, lr=cfg.lr, beta2_decay=a.beta2_decay, eps=(None, a.eps2), d=a.d, foreach=foreach)


def _lion(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.implementation != "auto":
        _not_offered(cfg, "its own step", "forja's Lion has one implementation")
    return Lion(groups, lr=cfg.lr, betas=tuple(cfg.lion.betas))


def _soap(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.implementation != "auto":
        _not_offered(cfg, "its own step", "forja's SOAP has one implementation")
    s = cfg.soap  # groups: from soap_param_groups (GROUPINGS), each with its precondition flag
    return Soap(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, shampoo_beta=s.shampoo_beta,
                precondition_frequency=s.precondition_frequency, max_precond_dim=s.max_precond_dim)


def _muon(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.implementation != "auto":
        _not_offered(cfg, "its own step", "forja's Muon has one implementation")
    m = cfg.muon  # groups: from muon_param_groups (GROUPINGS), each with its use_muon flag and lr
    return Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                ns_steps=m.ns_steps, ns_coefficients=tuple(m.ns_coefficients), update_scale=m.update_scale,
                betas=tuple(cfg.betas), eps=cfg.eps, bucket_bytes=m.bucket_bytes, orthogonalizer=m.orthogonalizer,
                cautious_weight_decay=m.cautious_weight_decay,
                ns_dtype={"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}[m.ns_dtype])


# Each optimizer's default learning rate, taken when `--set optim.name` switches to it without
# `--set optim.lr`, is DEFAULT_LR in forja/optim/config.py (config loading may import only the
# sections' config modules, so the table lives there); a test checks it names every one here.
OPTIMIZERS: dict[str, Callable[[list[dict], OptimConfig], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "adam": _adam,
    "sgd": _sgd,
    "muon": _muon,
    "adafactor": _adafactor,
    "lion": _lion,
    "soap": _soap,
}


# Optimizers whose groups depend on parameter names, not only on shapes: their grouping.
GROUPINGS: dict[str, Callable[[nn.Module, OptimConfig], list[dict]]] = {
    "muon": muon_param_groups,
    "soap": soap_param_groups,
}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise ForjaError(f"optim.name = {cfg.name!r} is not known; choose one of {', '.join(OPTIMIZERS)}")
    grouping = GROUPINGS.get(cfg.name)
    groups = grouping(model, cfg) if grouping else param_groups(model, cfg.weight_decay)
    groups = apply_mup(model, groups, cfg.lr)  # the groups as they were when muP is off
    return OPTIMIZERS[cfg.name](groups, cfg)


class OptimizerGroup:
    """One optimizer per model part, stepped together.

    A rank holds several parts when it runs several pipeline stages; a checkpoint must
    name each parameter by its place in the whole model, which
    `torch.distributed.checkpoint.state_dict` can do only one module at a time.
    """

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig):
        self.parts, self.cfg = parts, cfg  # cfg: also read around the step (QK-clip, train/step/attention_logits.py)
        self.optimizers = [build_optimizer(part, cfg) for part in parts]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
