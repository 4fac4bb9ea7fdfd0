"""Per-rank memory of FSDP (ZeRO-3) and ZeRO-2 against one process, on CPU (Gloo).

The model is built through forja's own path (`build_model_parts` with a
`ParallelConfig`, `ParallelDims` and the device mesh, then forja's optimizer), so this
measures what the trainer holds. Each layout takes one AdamW step, then a second step is
measured:

- **state**: bytes of the tensors a rank keeps between steps, right after the optimizer
  step: its local shards of the parameters (`DTensor.to_local()`), of the gradients and of
  the optimizer state. Storages are counted once each and whole, so FSDP's padding of
  uneven shards counts. Expected: the single-process figure / N.
- **gathered**: bytes of full (unsharded) parameters still held between forward and
  backward: what `parallel.reshard_after_forward` changes. FSDP swaps each module's
  parameters between sharded DTensors and plain full tensors, so after forward the plain
  ones are the gathered ones. ZeRO-3 keeps only the root's and the last block's (backward
  needs them at once); ZeRO-2 keeps every block's.
- **peak**: the most tensor memory alive during forward + backward: the state at the start
  (parameter shards, buffers, optimizer state; gradients were freed by zero_grad) plus
  the highest point of the running sum of every allocation and free the CPU allocator
  made meanwhile, as recorded by `torch.profiler` (profile_memory). Gathered parameters,
  activations and gradients all count; memory Gloo allocates outside the torch allocator
  does not.

    python bench/memory.py                           # llama tiny, degrees 1 2 4
    python bench/memory.py --flavor tiny --degrees 1 2 4 --batch 2 --seq-len 128
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/profiling.py

from profiling import allocator_peak  # noqa: E402

from forja.models import model_args  # noqa: E402
from forja.models.common.transformer import next_token_loss  # noqa: E402
from forja.optim import OptimizerGroup  # noqa: E402
from forja.optim.config import OptimConfig  # noqa: E402
from forja.parallel.config import ParallelConfig  # noqa: E402
from forja.parallel.dims import ParallelDims  # noqa: E402
from forja.testing import run_distributed  # noqa: E402
from forja.train.build import build_model_parts  # noqa: E402

MB = 1e6


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(group: OptimizerGroup) -> list[torch.Tensor]:
    return [v for opt in group.optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def measure(rank: int, world_size: int, flavor: str, reshard: bool, batch: int, seq_len: int) -> dict:
    torch.set_num_threads(1)  # several ranks share the cores
    cfg = ParallelConfig(reshard_after_forward=reshard)
    dims = ParallelDims.from_config(cfg, world_size)
    dims.build_mesh("cpu")
    args = model_args("llama", flavor)
    model = build_model_parts(args, dims, cfg, device=torch.device("cpu"), seed=0).parts[0]
    optim = OptimizerGroup([model], OptimConfig())
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=gen)

    def forward() -> torch.Tensor:
        return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])

    forward().backward()
    optim.step()
    params = list(model.parameters())
    state = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
             "optim": storage_bytes(optimizer_tensors(optim))}
    optim.zero_grad(set_to_none=True)
    start = storage_bytes([*params, *model.buffers(), *optimizer_tensors(optim)])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = forward()
        gathered = storage_bytes(p for p in model.parameters() if not isinstance(p, DTensor))
        loss.backward()
    return {**state, "gathered": gathered, "peak": start + allocator_peak(prof)}


def run_layout(degree: int, reshard: bool, ns: argparse.Namespace) -> dict:
    per_rank = run_distributed(measure, degree, ns.flavor, reshard, ns.batch, ns.seq_len, timeout_s=300)
    # The most loaded rank: uneven shards make the ranks differ by a little.
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    ns = parser.parse_args()
    args = model_args("llama", ns.flavor)
    print(f"llama {ns.flavor}: dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}; AdamW, fp32; "
          f"batch {ns.batch} x {ns.seq_len} tokens per rank; torch {torch.__version__}, {platform.machine()}")
    rows, full = [], None
    for degree in ns.degrees:
        for reshard in ([True, False] if degree > 1 else [True]):
            r = run_layout(degree, reshard, ns)
            state = r["params"] + r["grads"] + r["optim"]
            full = full or (state if degree == 1 else None)
            rows.append((degree, reshard, r, state))
    if full is None:
        raise SystemExit("--degrees must include 1: the single-process figure is the baseline")
    print("| FSDP degree | ZeRO stage | params + grads + optimizer MB/rank | expected (full/N) | ratio "
          "| gathered params held fwd->bwd MB | peak during fwd+bwd MB/rank |")
    print("|---|---|---|---|---|---|---|")
    for degree, reshard, r, state in rows:
        # One process has no FSDP: every parameter is a full tensor, and none is "gathered".
        stage, gathered = ("-", "-") if degree == 1 else ("3" if reshard else "2", f"{r['gathered'] / MB:.1f}")
        print(f"| {degree} | {stage} | {state / MB:.1f} (p {r['params'] / MB:.1f}, g {r['grads'] / MB:.1f}, "
              f"o {r['optim'] / MB:.1f}) | {full / degree / MB:.1f} | {state / (full / degree):.3f} "
              f"| {gathered} | {r['peak'] / MB:.1f} |")


if __name__ == "__main__":
    main()
