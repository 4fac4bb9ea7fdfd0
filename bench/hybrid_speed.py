"""Training speed of a Qwen3.5-shaped hybrid (Gated DeltaNet 3 : gated attention 1) against the
same-size model with full attention in every block, at long contexts: where linear attention's
fixed-size state overtakes attention's cost that grows with the context.

    python bench/hybrid_speed.py                            # CPU: 2k, 8k and 32k tokens
    python bench/hybrid_speed.py --seq-lens 2048 8192 --rounds 3
    python bench/hybrid_speed.py --device cuda --dim 1024   # with fla's kernels when installed

Both models are `qwen3_5` built from the same flavor and overrides; the baseline sets
`layer_types` to full_attention everywhere (so its blocks differ only in the sequence mixer,
its parameter count differs by under 1%: printed). A timing is one training step of one sequence
(forward, loss, backward), the two models alternating round by round after one warm-up each (at
the first length; lengths past --long are timed once), so a busy machine slows them alike; the table has each one's
median and the hybrid's speed
ratio first. Attention is torch's SDPA (flash on CUDA, its fused CPU kernel on CPU); the
delta rule is forja's chunked PyTorch form on CPU, fla's kernel on CUDA when installed.
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


def step_seconds(model, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    if tokens.is_cuda:
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--long", type=int, default=8192, help="longer sequences are timed once (minutes a step on CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    heads = max(2, args.dim // 64)
    shape = dict(dim=args.dim, n_layers=args.layers, n_heads=heads, n_kv_heads=max(1, heads // 2), head_dim=64,
                 ffn_dim=3 * args.dim, linear_n_k_heads=max(1, heads // 2), linear_n_v_heads=heads,
                 linear_k_head_dim=64, linear_v_head_dim=64, vocab_size=2048, max_seq_len=max(args.seq_lens) + 1)
    models = {
        "hybrid (3 Gated DeltaNet : 1 attention)": build_model("qwen3_5", "debug", seed=0, **shape),
        "full attention": build_model("qwen3_5", "debug", seed=0, layer_types=("full_attention",) * args.layers,
                                      **shape),
    }
    for name, m in models.items():
        m.to(args.device).train()
        print(f"{name}: {m.num_params():,} parameters, layer_types {list(m.args.layer_types)}")
    print(f"device {args.device}, torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds\n")
    print("| tokens | hybrid s/step | full attention s/step | hybrid tokens/s | full tokens/s | hybrid speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, T in enumerate(args.seq_lens):
        tokens = torch.randint(0, 2048, (1, T + 1), generator=torch.Generator().manual_seed(0)).to(args.device)
        times: dict[str, list[float]] = {name: [] for name in models}
        if i == 0:  # first calls allocate and (on CUDA) pick kernels: once, at the first length
            for m in models.values():
                step_seconds(m, tokens)
        rounds = args.rounds if T <= args.long else 1
        for _ in range(rounds):
            for name, m in models.items():
                times[name].append(step_seconds(m, tokens))
        hybrid, full = (statistics.median(times[n]) for n in models)
        print(f"| {T:,} | {hybrid:.3f} | {full:.3f} | {T / hybrid:,.0f} | {T / full:,.0f} | **{full / hybrid:.2f}x** |",
              flush=True)


if __name__ == "__main__":
    main()
