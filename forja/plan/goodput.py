"""Goodput under failures: the share of a job's GPU time that ends as committed training, for
three ways of living with failures (docs/planner.md, "Goodput under failures"):

    restart   the whole job stops on any failure, relaunches and reloads the last checkpoint
    ft        torchft replica groups (ft.mode = "hsdp"): the failed group restarts and heals
              from a live peer while the others train on
    diloco    the same groups synchronising every H inner steps (ft.mode = "diloco")

The closed forms are first order in the failure rate (Young/Daly); `simulate` plays the same
model out with random failures (overlapping outages, failures during a restart) to check them.
It is a model: failures independent and memoryless, every group alike, and a DiLoCo token
counted as worth a synchronous one, which is a convergence question it does not answer.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, replace

from forja.errors import ForjaError

HOUR = 3600.0
# Meta's Llama 3 405B run: 419 unexpected interruptions in 54 days on 16,384 H100s
# (Llama 3 paper, section 3.3.4), i.e. 419 / (54 * 24 * 16,384) per GPU-hour.
LLAMA3_FAILURE_RATE = 419 / (54 * 24 * 16384)
SIZES = (8, 64, 512, 4096, 16384)
POLICIES = ("restart", "ft", "diloco")


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """What the goodput depends on, besides the job's size (every time in seconds)."""

    failure_rate: float = LLAMA3_FAILURE_RATE
    """Failures per GPU-hour that stop the GPU's process (hardware, driver, network)."""
    step_s: float = 2.0
    """The synchronous job's step time, one all-reduce of the gradients across groups included."""
    checkpoint_interval: int = 500
    """Steps between checkpoints (checkpoint.interval); all three policies keep saving."""
    checkpoint_save_s: float = 30.0
    """Training time one save blocks (with checkpoint.async_save, only its staging)."""
    restart_s: float = 300.0
    """restart: from the failure to training again: relaunch, rendezvous, NCCL, checkpoint load."""
    group_gpus: int = 8
    """GPUs of one replica group (ft, diloco): the job has gpus / group_gpus groups."""
    heal_s: float = 120.0
    """ft, diloco: a failed group's time away: its restart plus the copy of the state from a peer."""
    detect_s: float = 30.0
    """ft, diloco: how long a collective waits for a dead group (ft.timeout_s)."""
    inner_steps: int = 20
    """diloco: steps between two synchronisations (ft.inner_steps)."""
    sync_s: float = 0.2
    """diloco: one all-reduce of the fp32 weight deltas across the groups (the outer step)."""

    def __post_init__(self) -> None:
        if not self.failure_rate >= 0:
            raise ForjaError(f"failure rate {self.failure_rate}: give 0 or more failures per GPU-hour")
        for key in ("step_s", "checkpoint_save_s", "restart_s", "heal_s", "detect_s", "sync_s"):
            if not getattr(self, key) >= 0:
                raise ForjaError(f"goodput {key} = {getattr(self, key)}: give 0 or more seconds")
        if self.step_s <= 0 or self.checkpoint_interval < 1 or self.group_gpus < 1 or self.inner_steps < 1:
            raise ForjaError("goodput needs a step time > 0 and a checkpoint interval, group size and inner "
                             "steps of 1 or more")

    def job_rate(self, gpus: int) -> float:
        """lambda: failures per second of the whole job."""
        return gpus * self.failure_rate / HOUR

    def groups(self, gpus: int) -> int:
        return max(1, gpus // self.group_gpus)

    def diloco_step_s(self) -> float:
        """A DiLoCo step: the per-step all-reduce across groups (at most half the step) is gone,
        one sync every inner_steps is paid instead."""
        return self.step_s - min(self.sync_s, self.step_s / 2) + self.sync_s / self.inner_steps


GROUP_RESTART_S = 120.0  # a group's relaunch (processes, CUDA, NCCL, model build), before its heal


def recipe_model(cfg, job, step_s: float, hw) -> FailureModel:
    """The defaults for a recipe planned on `hw`: its predicted step time, checkpoint interval and
    [ft] settings, groups of a node, and the transfers sized from the model: a sync all-reduces
    each rank's shard of the fp32 weights across the groups (a ring: twice its bytes over the
    NIC), a heal copies a rank's shard of the weights and optimizer state from a peer."""
    group = hw.gpus_per_node
    base = FailureModel(step_s=step_s, checkpoint_interval=cfg.checkpoint.interval or 500, group_gpus=group,
                        detect_s=cfg.ft.timeout_s, inner_steps=cfg.ft.inner_steps)
    bw = hw.inter_node_bytes_per_s
    if not bw:  # an unknown NIC: the transfers keep their defaults
        return base
    weights = job.shape.n_params * 4 / group
    return replace(base, sync_s=2 * weights / bw,
                   heal_s=GROUP_RESTART_S + weights * (1 + job.state_per_param) / bw)


def _saving(m: FailureModel) -> float:
    """1 + C / tau: the time checkpointing adds to each unit of training. tau is the interval in
    the synchronous job's time: DiLoCo saves as often in time, not in its own (faster) steps."""
    return 1 + m.checkpoint_save_s / (m.checkpoint_interval * m.step_s)


def restart_goodput(m: FailureModel, gpus: int) -> float:
    """First order: each failure loses R and, on average, half of a checkpoint period."""
    tau = m.checkpoint_interval * m.step_s
    lost = m.job_rate(gpus) * (m.restart_s + (tau + m.checkpoint_save_s) / 2)
    return max(0.0, 1 - lost) / _saving(m)


def restart_goodput_exact(m: FailureModel, gpus: int) -> float:
    """Daly's expectation for memoryless failures (those during a restart included)."""
    lam, tau = m.job_rate(gpus), m.checkpoint_interval * m.step_s
    if lam == 0:
        return 1 / _saving(m)
    return lam * tau / (math.exp(lam * m.restart_s) * math.expm1(lam * (tau + m.checkpoint_save_s)))


def young_interval(m: FailureModel, gpus: int) -> int:
    """Young's optimal checkpoint interval sqrt(2 C / lambda), in steps (0: no failures)."""
    lam = m.job_rate(gpus)
    if lam == 0:
        return 0
    return max(1, round(math.sqrt(2 * m.checkpoint_save_s / lam) / m.step_s))


def ft_goodput(m: FailureModel, gpus: int) -> float | None:
    """Each failure: every group loses the step under way and the wait for the dead one
    (t + d); the failed group is away for heal_s, 1/G of the job. None: one group only."""
    g = m.groups(gpus)
    if g < 2:
        return None
    lost = m.job_rate(gpus) * (m.step_s + m.detect_s + m.heal_s / g)
    return max(0.0, 1 - lost) / _saving(m)


def diloco_goodput(m: FailureModel, gpus: int) -> float | None:
    """As ft, but only a sync under way waits for the dead group, and the failed group also
    loses its inner steps since the last sync (H / 2 on average). Against DiLoCo's own speed."""
    g, t_d = m.groups(gpus), m.diloco_step_s()
    if g < 2:
        return None
    in_sync = min(1.0, m.sync_s / m.inner_steps / t_d)
    lost = m.job_rate(gpus) * (m.detect_s * in_sync + (m.heal_s + m.inner_steps / 2 * t_d) / g)
    return max(0.0, 1 - lost) / _saving(m)


def goodput_row(m: FailureModel, gpus: int) -> dict:
    """One job size: every policy's goodput, Young's interval, and DiLoCo's tokens/s against
    the failure-free synchronous job (its goodput times its speed-up)."""
    young = young_interval(m, gpus)
    diloco = diloco_goodput(m, gpus)
    return {"gpus": gpus, "groups": m.groups(gpus), "job_failures_per_day": m.job_rate(gpus) * 86400,
            "restart": restart_goodput(m, gpus),
            "young_interval_steps": young,
            "restart_at_young": restart_goodput(replace(m, checkpoint_interval=young), gpus) if young else
            restart_goodput(m, gpus),
            "ft": ft_goodput(m, gpus), "diloco": diloco,
            "diloco_throughput": None if diloco is None else diloco * m.step_s / m.diloco_step_s()}


def table(m: FailureModel, sizes=SIZES) -> list[dict]:
    return [goodput_row(m, n) for n in sizes]


# -- Monte-Carlo: the same model with random failures ------------------------------------------

def simulate(policy: str, m: FailureModel, gpus: int, *, hours: float, seed: int = 0) -> float | None:
    """Goodput of `policy` over `hours` of wall time with Poisson failures at the job's rate."""
    if policy not in POLICIES:
        raise ForjaError(f"policy {policy!r}: give one of {', '.join(POLICIES)}")
    rng, horizon = random.Random(seed), hours * HOUR
    if policy == "restart":
        return _simulate_restart(m, gpus, rng, horizon)
    if m.groups(gpus) < 2:
        return None
    return _simulate_groups(m, gpus, rng, horizon, diloco=policy == "diloco")


def _simulate_restart(m: FailureModel, gpus: int, rng: random.Random, horizon: float) -> float:
    """Checkpoint periods of tau + C; a failure throws the period under way away and costs a
    restart, which a failure during it begins again."""
    lam, tau = m.job_rate(gpus), m.checkpoint_interval * m.step_s
    period = tau + m.checkpoint_save_s
    now = work = 0.0
    while now < horizon:
        gap = rng.expovariate(lam) if lam else math.inf
        if now + gap >= horizon:
            return (work + (horizon - now) / period * tau) / horizon
        work += (gap // period) * tau
        now += gap
        while (again := rng.expovariate(lam)) < m.restart_s:
            now += again
        now += m.restart_s
    return work / horizon


def _simulate_groups(m: FailureModel, gpus: int, rng: random.Random, horizon: float, *, diloco: bool) -> float:
    """Failures strike a random group; a live one is away for heal_s (and, under DiLoCo, has
    lost its inner steps since the last sync), one already away stays away longer."""
    g, lam = m.groups(gpus), m.job_rate(gpus)
    t_d = m.diloco_step_s() if diloco else m.step_s
    in_sync = min(1.0, m.sync_s / m.inner_steps / t_d)
    away_until, ends = [0.0] * g, []  # ends: a heap of the away groups' return times
    lost, now = 0.0, 0.0  # lost: group-seconds of training lost
    while lam and (now := now + rng.expovariate(lam)) < horizon:
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        live, k = g - len(ends), rng.randrange(g)
        if away_until[k] > now:  # already away: the restart begins again
            lost += now + m.heal_s - away_until[k]
            ends.remove(away_until[k])
            heapq.heapify(ends)
        else:
            redone = rng.random() * m.inner_steps * t_d if diloco else 0.0
            stalled = m.detect_s * (rng.random() < in_sync) if diloco else m.step_s + m.detect_s
            lost += min(m.heal_s, horizon - now) + redone + stalled * live
        away_until[k] = now + m.heal_s
        heapq.heappush(ends, away_until[k])
    return max(0.0, 1 - lost / (g * horizon)) / _saving(m)
