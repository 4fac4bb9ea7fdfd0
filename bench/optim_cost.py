"""What each optimizer costs against AdamW: its first step, its later steps, its state.

    python bench/optim_cost.py                          # the debug and default recipes' models
    python bench/optim_cost.py --models debug --steps 12
    python bench/optim_cost.py --threads 1              # on a CPU another job shares
    python bench/optim_cost.py --soap-everything        # and SOAP as it was: embeddings, output rotated too

For each registered optimizer (forja/optim/optimizers.py, at its DEFAULT_LR), on the model of
`configs/debug.toml` (Llama `debug`, 2,048-token vocabulary) and of `configs/default.toml`
(Llama `tiny`, 8,192): the time of the first training step (forward, backward, clip, optimizer
step; the optimizer's state and any preconditioner are built there), the median of the later
steps, the slowest later step (SOAP refreshes its bases every `precondition_frequency` steps),
the optimizer.step alone, and the bytes of the optimizer's state after the last step, each as a
ratio to AdamW measured in the same run.

Every model takes one forward and backward before its first timed step, so that step 1 counts
the optimizer's first-step work and not torch's own first-call costs. The optimizers step in
turn (step 1 of each, then step 2 of each, ...), so a busy machine slows them all alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.models import build_model  # noqa: E402
from forja.optim import build_optimizer  # noqa: E402
from forja.optim.config import DEFAULT_LR, OptimConfig, SoapConfig  # noqa: E402
from forja.optim.optimizers import OPTIMIZERS  # noqa: E402
from forja.optim.params import ADAMW_BY_RULE  # noqa: E402

# The recipes' models and batches: (flavor, vocabulary, batch, seq_len) of configs/debug.toml, default.toml.
RECIPES = {"debug": ("debug", 2048, 8, 128), "default": ("tiny", 8192, 8, 256)}


@dataclass
class Cost:
    """One optimizer's measured times (seconds) and state."""

    whole: list[float] = field(default_factory=list)
    """Each step's time: forward, backward, clip and optimizer step; [0] is the first."""
    opt: list[float] = field(default_factory=list)
    """Each step's optimizer.step alone."""
    state_bytes: int = 0
    """Bytes of the optimizer's state tensors after the last step (this process's shards)."""


def later(times: list[float]) -> float:
    """The median of the steps after the first."""
    return statistics.median(times[1:])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer keeps as state (shards as held)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def _step(model: nn.Module, optimizer: torch.optim.Optimizer | None, tokens: torch.Tensor) -> tuple[float, float]:
    """One training step; (its time, its optimizer.step's time). No optimizer: forward and backward."""
    start = time.perf_counter()
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    end = time.perf_counter()
    return end - start, end - before


def measure(make_model, configs: dict[str, OptimConfig], steps: int, tokens: torch.Tensor) -> dict[str, Cost]:
    """Each labelled optimizer config's Cost over `steps` steps of its own copy of `make_model()`
    on `tokens`."""
    runs = {}
    for name, cfg in configs.items():
        model = make_model()
        _step(model, None, tokens)  # torch's first-call work, off the clock
        model.zero_grad(set_to_none=True)
        runs[name] = (model, build_optimizer(model, cfg))
    costs = {name: Cost() for name in configs}
    for _ in range(steps):
        for name, (model, optimizer) in runs.items():  # in turn: a busy machine slows each alike
            whole, opt = _step(model, optimizer, tokens)
            costs[name].whole.append(whole)
            costs[name].opt.append(opt)
    for name, (_, optimizer) in runs.items():
        costs[name].state_bytes = state_bytes(optimizer)
    return costs


def table(costs: dict[str, Cost]) -> str:
    """A markdown table, every figure also as a ratio to AdamW's (the entry "adamw")."""
    base = costs["adamw"]
    b_later, b_opt, b_state = later(base.whole), later(base.opt), base.state_bytes
    rows = ["| optimizer | step 1 s | later s (median) | step 1 / later | later vs AdamW | slowest later s | "
            "opt.step 1 s | opt.step later s | opt.step later vs AdamW | state MiB | state vs AdamW |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in costs.items():
        step_later, opt_later = later(c.whole), later(c.opt)
        rows.append(f"| {name} | {c.whole[0]:.3f} | {step_later:.3f} | {c.whole[0] / step_later:.2f}x | "
                    f"{step_later / b_later:.2f}x | "
                    f"{max(c.whole[1:]):.3f} | {c.opt[0]:.4f} | {opt_later:.4f} | {opt_later / b_opt:.2f}x | "
                    f"{c.state_bytes / 2**20:.2f} | {c.state_bytes / b_state:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--steps", type=int, default=12, help="steps per optimizer (step 11 has SOAP's first refresh)")
    p.add_argument("--only", nargs="+", choices=list(OPTIMIZERS), help="these optimizers (AdamW always)")
    p.add_argument("--soap-everything", action="store_true",
                   help="also SOAP preconditioning the embeddings and output too, as it did before they went to "
                        "Adam (on the default recipe: 8,192^2 factors, minutes)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 on a CPU another job shares")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 2:
        p.error("--steps must be >= 2: the first step and at least one later one")
    names = ["adamw"] + [n for n in (args.only or OPTIMIZERS) if n != "adamw"]
    configs = {name: OptimConfig(name=name, lr=DEFAULT_LR[name]) for name in names}
    if args.soap_everything:  # every matrix preconditioned: SOAP before it left these to Adam
        configs["soap, every matrix"] = OptimConfig(name="soap", lr=DEFAULT_LR["soap"],
                                                    soap=SoapConfig(soap_patterns=list(ADAMW_BY_RULE)))
    for recipe in args.models:
        flavor, vocab, batch, seq_len = RECIPES[recipe]
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        costs = measure(lambda: build_model("llama", flavor), configs, args.steps, tokens)
        print(f"\n{recipe} recipe: Llama {flavor}, {batch} x {seq_len} tokens, {args.steps} steps each, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads ({time.perf_counter() - start:.0f} s)")
        print(table(costs))


if __name__ == "__main__":
    main()
