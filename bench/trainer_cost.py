"""What forja's Trainer costs a step beyond its own model in a plain loop, measured in one process.

    python bench/trainer_cost.py --rounds 9
    python bench/trainer_cost.py --rounds 9 --set parallel.compile=true

bench/peers.py runs each contender in a process of its own, so its "Trainer against the bare
loop" figure also holds whatever differs between two processes (where their pages and threads
landed). Here both are built in one process, from bench/peers.py's spec and builders
(bench/peers_forja.py: `Trainer.train_one_step` on the recipe, and the same model by forja's
build order in a loop of forward, backward, clip and fused AdamW on the same token rows, under
the same host settings), and timed in turn, 2 steps a round, each round's order flipped. Then
the profiler counts every operator each runs over 3 steps: an operator the Trainer calls more
often is work the bare loop does not do. Prints both medians, the ratio and the operators whose
counts differ; `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
import peers_forja  # noqa: E402


def spec_for(size: str, sets: list[str], out: Path) -> dict:
    """bench/peers.py's spec for `size` (causal attention, forja's host settings), forja's
    compile switch read from `sets`."""
    spec, _ = peers.run_spec(peers.SIZES[size], sets, out, device="cpu", host=peers.HOSTS["forja"], warmup=0,
                             per_document=False)
    return {**spec, "compile": any(s.replace(" ", "") == "parallel.compile=true" for s in sets)}


def timed(steps: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds a step, 2 steps a round for each, the order flipped every round."""
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            steps[name]()
            steps[name]()
            times[name].append((time.perf_counter() - start) / 2)
    return times


def operator_counts(step, n: int = 3) -> dict[str, int]:
    """How many times each operator runs in `n` steps (the profiler's count)."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(n):
            step()
    return {event.key: event.count for event in prof.key_averages()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(peers.SIZES), default="cpu")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2, help="steps each runs before timing (compilation)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="forja override, for both")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    spec = spec_for(args.size, args.sets, Path(tempfile.mkdtemp(prefix="trainer-cost-")))
    steps = {"Trainer": peers_forja.build(spec).step, "bare loop": peers_forja.build({**spec, "bare": True}).step}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times = timed(steps, args.rounds)
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    counts = {name: operator_counts(step) for name, step in steps.items()}
    differ = {op: [counts["Trainer"].get(op, 0), counts["bare loop"].get(op, 0)]
              for op in sorted(set(counts["Trainer"]) | set(counts["bare loop"]))
              if counts["Trainer"].get(op, 0) != counts["bare loop"].get(op, 0)}
    result = {"ms": ms, "rounds_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in times.items()},
              "trainer_over_bare": ms["Trainer"] / ms["bare loop"], "counts_differ": differ,
              "sets": args.sets, "size": args.size, "torch": torch.__version__}
    print(f"Trainer {ms['Trainer']:.1f} ms a step, bare loop {ms['bare loop']:.1f} ms "
          f"(median of {args.rounds} rounds): the Trainer's step takes {result['trainer_over_bare']:.3f}x")
    print("operators run a different number of times over 3 steps (Trainer, bare loop):")
    for op, (a, b) in differ.items():
        print(f"  {op}: {a}, {b}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
