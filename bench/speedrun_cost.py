"""The cost a step of switches on the speedrun recipe, measured side by side in one process.

    python bench/speedrun_cost.py --rounds 8

Each variant (configs/speedrun.toml with its overrides) is built with its optimizer, and the
variants take turns, round after round, on the same micro-batches: the recipe's bf16 autocast
forward and backward over its micro-batches, then the optimizer step. Taking turns spreads
whatever else the machine does over all of them, so the ratios hold where wall times would
not. Reported: each variant's median step and its ratio to the first. The held-out loss the
switches give is bench/loss_race.py's; bench/RESULTS.md puts the two together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forja.config import load_config  # noqa: E402
from forja.models.config import run_model_args  # noqa: E402
from forja.models.registry import build_from_args  # noqa: E402
from forja.optim.optimizers import build_optimizer  # noqa: E402

VE2 = "model.overrides={qk_norm = true, value_embeddings = 2}"  # the recipe's own override, plus the tables
VARIANTS = {"speedrun": [], "+ value embeddings (2 tables)": [VE2], "+ MTP depth 1": ["model.mtp.depth=1"],
            "+ both": [VE2, "model.mtp.depth=1"]}


def build(sets: list[str]):
    """(model, optimizer, config) of the speedrun recipe with `sets` applied."""
    cfg = load_config(str(REPO / "configs" / "speedrun.toml"), sets)
    model = build_from_args(run_model_args(cfg.model, cfg.data.vocab_size), seed=0)
    return model, build_optimizer(model, cfg.optim), cfg


def step(model, optimizer, batches: list[torch.Tensor]) -> None:
    """One training step: bf16 autocast forward + backward per micro-batch (B, T + 1), then the update."""
    for rows in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(rows[:, :-1], labels=rows[:, 1:])
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--set", dest="sets", action="append", default=[], help="an override for every variant")
    args = p.parse_args(argv)
    runs = {name: build([*sets, *args.sets]) for name, sets in VARIANTS.items()}
    cfg = next(iter(runs.values()))[2]
    t = cfg.train
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.data.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
               for _ in range(t.global_batch_size // t.micro_batch_size)]
    for model, optimizer, _ in runs.values():  # warm-up: the optimizers' state, the allocator
        step(model, optimizer, batches)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, optimizer, _) in runs.items():
            start = time.perf_counter()
            step(model, optimizer, batches)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(v) for name, v in times.items()}
    first = next(iter(medians.values()))
    for name, s in medians.items():
        print(f"{name:32s} {s * 1e3:8.1f} ms a step  {s / first:.3f}x")
    return medians


if __name__ == "__main__":
    main()
