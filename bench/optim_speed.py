"""Time per training step of each optimizer, like for like: one process, the same model
(the default recipe's Llama `tiny`), the same batches, the optimizers measured in alternating
rounds so that a busy machine slows them all alike.

    python bench/optim_speed.py                    # 8 x 128 tokens, 5 rounds of 4 steps
    python bench/optim_speed.py --batch 8 --seq-len 256 --rounds 5 --steps 4

Reports, per optimizer: the median time of a whole step (forward, backward, clip, optimizer
step) and of the optimizer step alone, each as a ratio to AdamW measured in the same rounds.
SOAP runs with max_precond_dim = 1024, as in bench/optimizers.py (the same as its default here,
now that SOAP leaves the embeddings and the output to Adam). First steps and optimizer state:
bench/optim_cost.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.models import build_model  # noqa: E402
from forja.optim import build_optimizer  # noqa: E402
from forja.optim.config import OptimConfig, SoapConfig  # noqa: E402

CONFIGS = {
    "adamw": OptimConfig(name="adamw", lr=3e-3),
    "muon": OptimConfig(name="muon", lr=1e-2),
    "lion": OptimConfig(name="lion", lr=1e-3),
    "adafactor": OptimConfig(name="adafactor", lr=3e-2),
    "soap": OptimConfig(name="soap", lr=3e-3, soap=SoapConfig(max_precond_dim=1024)),
}


def timed_steps(model, optim, tokens, labels, steps: int) -> tuple[list[float], list[float]]:
    whole, opt_only = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optim.zero_grad()
        model(tokens, labels=labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = time.perf_counter()
        optim.step()
        end = time.perf_counter()
        whole.append(end - start)
        opt_only.append(end - before)
    return whole, opt_only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, 8192, (args.batch, args.seq_len + 1))
    runs = {}
    for name, cfg in CONFIGS.items():
        model = build_model("llama", "tiny")
        model.init_weights(0)
        runs[name] = (model, build_optimizer(model, cfg))
        timed_steps(*runs[name], tokens[:, :-1], tokens[:, 1:], 2)  # warm-up: state, first bases
    times = {name: ([], []) for name in CONFIGS}
    for _ in range(args.rounds):
        for name, (model, optim) in runs.items():
            whole, opt = timed_steps(model, optim, tokens[:, :-1], tokens[:, 1:], args.steps)
            times[name][0].extend(whole)
            times[name][1].extend(opt)
    base_whole, base_opt = (statistics.median(t) for t in times["adamw"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Llama tiny, {args.batch} x {args.seq_len} "
          f"tokens, {args.rounds} rounds x {args.steps} steps each")
    print("| optimizer | step s (median) | vs AdamW | optimizer.step s | vs AdamW |\n|---|---:|---:|---:|---:|")
    for name, (whole, opt) in times.items():
        w, o = statistics.median(whole), statistics.median(opt)
        print(f"| {name} | {w:.3f} | {w / base_whole:.2f}x | {o:.4f} | {o / base_opt:.2f}x |")


if __name__ == "__main__":
    main()
