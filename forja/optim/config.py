"""The [optim] and [schedule] sections of a config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from forja.errors import ForjaError

# Each optimizer's measured best peak learning rate (bench/optimizer_lr.py: configs/debug.toml,
# 40 steps, a grid a factor ~3 apart; bench/RESULTS.md). `--set optim.name=X` without
# `--set optim.lr` scales the recipe's lr by DEFAULT_LR[X] / DEFAULT_LR[the recipe's optimizer]
# (forja/config.py). Lives here, not by the registry in optimizers.py, because config loading
# may import only the sections' config modules; a test checks it names every optimizer.
DEFAULT_LR: dict[str, float] = {
    "adamw": 3e-3,
    "adam": 3e-3,
    "sgd": 1e-1,
    "adafactor": 1e-1,
    "lion": 1e-3,
    "muon": 1e-2,
    "soap": 3e-3,
}


@dataclass(kw_only=True)
class MuonConfig:
    """[optim.muon]: Muon (Jordan et al. 2024) for the 2-D hidden matrices; every other
    parameter (embeddings, output projection, norms, biases, MoE routers) goes to AdamW."""

    momentum: float = 0.95
    """Momentum of the update before orthogonalization."""
    nesterov: bool = True
    """Nesterov momentum (orthogonalize g + momentum * buffer rather than the buffer)."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_coefficients: tuple[float, ...] = (3.4445, -4.775, 2.0315)
    """(a, b, c) of the quintic Newton-Schulz step X <- aX + b(XX^T)X + c(XX^T)^2 X."""
    orthogonalizer: Literal["newton_schulz", "polar_express"] = "newton_schulz"
    """newton_schulz: ns_coefficients at every step; polar_express: a minimax-optimal (a, b, c)
    for each step (Amsel et al. 2025), the singular values closer to 1 in as many steps."""
    cautious_weight_decay: bool = False
    """Decay a weight only where its update has the weight's sign (Chen et al. 2025): the decay
    never pushes against an update that already shrinks the weight."""
    ns_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """The dtype the orthogonalization computes in: auto = bf16 on CUDA, fp32 elsewhere (fp32
    keeps CPU runs equal across layouts within fp32 rounding); bf16 on a CPU with bf16 matrix
    units (AMX) halves its time (bench/RESULTS.md, "The best model per second")."""
    update_scale: Literal["rms_match", "spectral", "none"] = "rms_match"
    """Scale of the orthogonal update of an m x n matrix: rms_match = 0.2 sqrt(max(m, n)), so its
    RMS matches AdamW's and AdamW's learning rate and weight decay carry over (Liu et al. 2025);
    spectral = sqrt(max(1, m / n)) (Jordan); none = 1."""
    adamw_lr: float | None = None
    """Peak learning rate of the AdamW group; None: optim.lr."""
    adamw_patterns: list[str] = field(default_factory=list)
    """Parameter-name patterns (fnmatch, e.g. "*.attention.wo.weight") sent to AdamW though 2-D."""
    muon_patterns: list[str] = field(default_factory=list)
    """Parameter-name patterns sent to Muon though the rule would send them to AdamW."""
    bucket_bytes: int = 64 * 2**20
    """Distributed: the whole matrices one exchange moves to their owners and back, at most about
    (2 collectives a bucket; an owner holds its share of a bucket's matrices at once)."""


@dataclass(kw_only=True)
class LionConfig:
    """[optim.lion]: Lion (Chen et al. 2023), the sign of an interpolated momentum."""

    betas: tuple[float, ...] = (0.9, 0.99)
    """(beta1, beta2): the interpolation for the update and the momentum's decay."""


@dataclass(kw_only=True)
class AdafactorConfig:
    """[optim.adafactor]: Adafactor (Shazeer and Stern 2018) through torch.optim.Adafactor:
    factored second moments, no first moment."""

    beta2_decay: float = -0.8
    """The second-moment decay rate is 1 - step^beta2_decay."""
    eps2: float = 1e-3
    """Relative-step epsilon: the update is at least eps2 x the parameter's RMS."""
    d: float = 1.0
    """Clipping threshold of the update's RMS."""


@dataclass(kw_only=True)
class SoapConfig:
    """[optim.soap]: SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's preconditioner,
    for the 2-D hidden matrices; every other parameter (embeddings, output projection, norms,
    biases, MoE routers) takes a plain AdamW step, as with Muon (forja/optim/params.py)."""

    shampoo_beta: float = 0.95
    """Decay of the Kronecker factors' running averages."""
    precondition_frequency: int = 10
    """Steps between eigenbasis updates."""
    max_precond_dim: int = 10_000
    """A dimension larger than this gets no factor and is left unrotated (SOAP's reference cap)."""
    adamw_patterns: list[str] = field(default_factory=list)
    """Parameter-name patterns (fnmatch, e.g. "*.attention.wo.weight") sent to AdamW though 2-D."""
    soap_patterns: list[str] = field(default_factory=list)
    """Parameter-name patterns preconditioned though the rule sends them to AdamW (e.g. "output.weight")."""

    def __post_init__(self) -> None:
        if not 0 <= self.shampoo_beta < 1:
            raise ForjaError(f"optim.soap.shampoo_beta = {self.shampoo_beta} must be in [0, 1), e.g. 0.95")
        if self.precondition_frequency < 1:
            raise ForjaError(f"optim.soap.precondition_frequency = {self.precondition_frequency} must be >= 1, "
                             "e.g. 10 (steps between eigenbasis updates)")
        if self.max_precond_dim < 1:
            raise ForjaError(f"optim.soap.max_precond_dim = {self.max_precond_dim} must be >= 1, e.g. 10000 "
                             "(a dimension above it is not preconditioned)")


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer."""

    name: str = "adamw"
    """Optimizer: adamw, adam, sgd, adafactor, lion, muon or soap (see forja/optim/optimizers.py)."""
    lr: float = 3e-4
    """Peak learning rate (reached after warmup)."""
    betas: tuple[float, ...] = (0.9, 0.95)
    """Adam's moment decay rates (beta1, beta2); sgd uses beta1 as momentum."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms or biases)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """Kernel: auto = fused on CUDA and CPU (torch has both kernels), foreach elsewhere."""
    qk_clip_tau: float = 0.0
    """QK-clip (MuonClip with Muon; Kimi K2, arXiv 2507.20534): after each step, every attention
    head whose largest logit q.k/sqrt(d) in the step exceeded this has its query/key weights
    scaled so that it falls to this (forja/optim/qk_clip.py); any optimizer. 0 = off; Kimi K2: 100."""
    max_logit_metric: bool = False
    """Log attn/max_logit (over layers and heads, and per layer) every step without clipping; on
    whenever qk_clip_tau > 0. Costs one more q k^T product per layer."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Options of optim.name = "muon"."""
    lion: LionConfig = field(default_factory=LionConfig)
    """Options of optim.name = "lion"."""
    adafactor: AdafactorConfig = field(default_factory=AdafactorConfig)
    """Options of optim.name = "adafactor"."""
    soap: SoapConfig = field(default_factory=SoapConfig)
    """Options of optim.name = "soap"."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ForjaError(f"optim.lr = {self.lr} must be > 0")
        if len(self.betas) != 2:
            raise ForjaError(f"optim.betas = {list(self.betas)} must be two numbers, e.g. [0.9, 0.95]")
        if self.muon.bucket_bytes <= 0:
            raise ForjaError(f"optim.muon.bucket_bytes = {self.muon.bucket_bytes} must be > 0, e.g. 67108864 (64 MiB)")
        if not self.qk_clip_tau >= 0:
            raise ForjaError(f"optim.qk_clip_tau = {self.qk_clip_tau} must be >= 0 (0 turns QK-clip off; "
                             "Kimi K2 used 100)")


@dataclass(kw_only=True)
class ScheduleConfig:
    """The learning-rate schedule: linear warmup, then a decay."""

    name: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """After warmup: cosine or linear decay to min_lr_ratio, wsd (stable then decay), constant."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to optim.lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""
    decay_fraction: float = 0.2
    """wsd: the last fraction of the steps that decays (linearly) to min_lr_ratio."""
    groups: dict[str, dict] = field(default_factory=dict)
    """Per parameter group, schedule keys that differ, e.g. {adamw = {warmup_steps = 0}} with
    Muon (groups: muon, adamw; other optimizers: matrices, vectors)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ForjaError(f"schedule.warmup_steps = {self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ForjaError(f"schedule.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ForjaError(f"schedule.decay_fraction = {self.decay_fraction} must be in (0, 1]")
        keys = {f for f in self.__dataclass_fields__ if f != "groups"}
        for group, changes in self.groups.items():
            unknown = sorted(set(changes) - keys) if isinstance(changes, dict) else ["(not a table)"]
            if unknown:
                raise ForjaError(f"schedule.groups.{group} has no schedule key {unknown[0]!r}; "
                                 f"valid keys: {', '.join(sorted(keys))}")

    def for_group(self, group: str) -> ScheduleConfig:
        """This schedule with the keys that `groups` changes for parameter group `group`."""
        changes = self.groups.get(group)
        return self if not changes else dataclasses.replace(self, **changes, groups={})
