"""Mixture of experts under tensor parallelism: per-rank expert work, tp = 1 against tp = 2.

Under TP each rank routes and computes its 1/tp slice of an MoE layer's tokens, and the
routed experts are spread over the TP ranks (forja/models/common/tp_plan.py `SplitTokens`,
forja/parallel/ep.py `expert_layout`). This measures, for qwen3 `debug-moe` (fp32, CPU,
Gloo, one thread per rank) built as `forja train` builds it (meta -> TP + SP -> init):

- rows: token-slots entering the routed experts on each rank per step (a forward pre-hook
  on every `GroupedExperts`, after the dispatch), summed over the MoE layers;
- expert FLOPs: rows x 3 matmuls x 2 x dim x moe_ffn_dim, x 3 for forward + backward;
- wall time of a forward + backward, median over the steps after warm-up.

Baseline: tp = 1, measured in the same run. On one machine the two tp = 2 ranks share its
cores, so the wall time shows the communication and the smaller per-rank work together,
not a cluster's speed-up.

    python bench/moe_tp.py               # about a minute on 2 cores
    python bench/moe_tp.py --steps 8 --batch 4 --seq 256
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.testing import run_distributed  # noqa: E402


def _measure(rank: int, world: int, batch: int, seq: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    from forja.models import model_args
    from forja.models.common.moe import moe_layers
    from forja.parallel.config import ParallelConfig
    from forja.parallel.degrees import Degrees
    from forja.parallel.dims import ParallelDims
    from forja.parallel.tp import loss_context
    from forja.train.build import build_model_parts

    dims = ParallelDims(Degrees(tp=world))
    dims.build_mesh("cpu")
    cfg = ParallelConfig(tp=world, dp_shard=1, sequence_parallel=world > 1)
    args = model_args("qwen3", "debug-moe")
    model = build_model_parts(args, dims, cfg, device=torch.device("cpu"), seed=0).parts[0]
    rows = [0]
    for _, moe in moe_layers(model):
        moe.experts.register_forward_pre_hook(lambda m, inp: rows.__setitem__(0, rows[0] + len(inp[0])))
    gen = torch.Generator().manual_seed(0)
    times, counted = [], []
    for step in range(warmup + steps):
        tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)  # the same on every rank
        rows[0] = 0
        torch.distributed.barrier()
        start = time.perf_counter()
        with loss_context(world):
            model(tokens, labels=tokens.roll(-1, 1)).backward()
        torch.distributed.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            counted.append(rows[0])
    flops_per_row = 3 * 2 * args.dim * args.moe_ffn_dim * 3  # w1, w3, w2; forward + backward
    return {"rows": statistics.mean(counted), "expert_gflop": statistics.mean(counted) * flops_per_row / 1e9,
            "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    cpu = platform.processor() or platform.machine()
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}, "
          f"{torch.get_num_threads()} threads available, torch {torch.__version__}")
    print(f"command: python bench/moe_tp.py --batch {a.batch} --seq {a.seq} --steps {a.steps} --warmup {a.warmup}")
    base = None
    for tp in (1, 2):
        ranks = run_distributed(_measure, tp, a.batch, a.seq, a.steps, a.warmup, timeout_s=600)
        for rank, r in enumerate(ranks):
            base = base or r
            print(f"tp={tp} rank {rank}: expert rows/step {r['rows']:.0f} ({r['rows'] / base['rows']:.2f}x tp=1), "
                  f"expert GFLOP/step {r['expert_gflop']:.3f}, fwd+bwd {r['step_s'] * 1e3:.1f} ms "
                  f"({r['step_s'] / base['step_s']:.2f}x tp=1)")


if __name__ == "__main__":
    main()
