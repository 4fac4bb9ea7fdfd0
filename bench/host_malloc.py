"""train.host_malloc: a plain training loop over forja's model under glibc's defaults ("system")
and under "retain" (forja/host.py), each round a fresh process per policy, alternating.

    python bench/host_malloc.py [--recipe default] [--rounds 3] [--steps 6] [--batch 8] [--seq-len 256]

Per policy: median tokens/s, then per step the page faults, system and user CPU seconds, and
the process's peak RSS. The ratio retain / system comes first.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_round(policy: str, recipe: str, steps: int, batch: int, seq_len: int) -> dict:
    """In this process: apply `policy` first, then train `steps` steps after 3 of warm-up."""
    from forja import host

    host.apply_malloc(policy)
    import torch

    from forja.config import load_config
    from forja.models.config import run_model_args
    from forja.parallel import ParallelDims
    from forja.train.build import build_model_parts

    cfg = load_config(recipe, [f"train.seq_len={seq_len}"])
    args = run_model_args(cfg.model, cfg.data.vocab_size)
    dims = ParallelDims.from_config(cfg.parallel, 1)
    model = build_model_parts(args, dims, cfg.parallel, device=torch.device("cpu"), seed=0, load_weights=None,
                              seq_len=seq_len).parts[0]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()  # logits (B, T, V) fp32, and their gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        step()
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"tokens_per_s": batch * seq_len * steps / seconds,
            "faults": (after.ru_minflt - before.ru_minflt) / steps,
            "sys_s": (after.ru_stime - before.ru_stime) / steps, "user_s": (after.ru_utime - before.ru_utime) / steps,
            "peak_rss_gib": after.ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one_round(a.child, a.recipe, a.steps, a.batch, a.seq_len)))
        return
    runs: dict[str, list[dict]] = {"system": [], "retain": []}
    for r in range(a.rounds):
        for policy in (["system", "retain"] if r % 2 == 0 else ["retain", "system"]):
            cmd = [sys.executable, __file__, "--child", policy, "--recipe", a.recipe, "--steps", str(a.steps),
                   "--batch", str(a.batch), "--seq-len", str(a.seq_len)]
            out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
            runs[policy].append(json.loads(out.strip().splitlines()[-1]))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    print(f"retain / system: {med['retain']['tokens_per_s'] / med['system']['tokens_per_s']:.3f}x tokens/s "
          f"({a.recipe}, {a.batch} x {a.seq_len} tokens, medians of {a.rounds} rounds of {a.steps} steps)")
    print("| policy | tokens/s | page faults / step | system s / step | user s / step | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for k, m in med.items():
        print(f"| {k} | {m['tokens_per_s']:,.0f} | {m['faults']:,.0f} | {m['sys_s']:.3f} | {m['user_s']:.3f} | "
              f"{m['peak_rss_gib']:.2f} |")


if __name__ == "__main__":
    main()
