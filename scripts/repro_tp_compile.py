"""Does `torch.compile` of a tensor-parallel (DTensor) transformer block give eager's gradients?

    python scripts/repro_tp_compile.py                        # the default grid, 2 ranks, Gloo on CPU
    python scripts/repro_tp_compile.py --sp 1 --backends aot_eager --parts mlp

forja refuses parallel.compile with parallel.tp > 1 on the torch versions where this
script finds a wrong gradient (forja/parallel/checks.py). Self-contained on public torch
APIs, so it runs in any venv: a tiny Llama block (RMSNorm -> attention -> RMSNorm ->
SwiGLU, residual adds) gets forja's TP plan (forja/models/llama/parallelize.py), then the
same weights and inputs go through it eagerly and through `module.compile(...)`.
One line per configuration; exit status 1 when any gradient or output is off by more
than --tol (fp32) or the compiled run raised.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

B, T, DIM, HEADS, FFN = 2, 8, 32, 4, 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1, not HEADS: under TP each rank holds a slice of the heads (as forja does).
        q, k, v = (w(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention, self.ffn_norm, self.feed_forward = RMSNorm(DIM), Attention(), RMSNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def build(part: str) -> nn.Module:
    return {"block": Block, "attention": Attention, "mlp": MLP, "norm": lambda: RMSNorm(DIM)}[part]()


def plan(part: str, sp: bool) -> dict:
    """forja's block plan (forja/models/llama/parallelize.py), cut down to `part`."""
    seq = Shard(1) if sp else Replicate()
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    full = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
    if sp:
        full.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": gather, "feed_forward": gather})
    if part == "block":
        return full
    prefix = {"attention": "attention", "mlp": "feed_forward", "norm": "attention_norm"}[part]
    # The sub-module is the root here: its own style (gather, SequenceParallel) is keyed "".
    return {k[len(prefix) + 1:] if k != prefix else "": v for k, v in full.items() if k.startswith(prefix)}


def run_once(model: nn.Module, x: torch.Tensor, weight: torch.Tensor):
    """(output, input grad, {name: full grad}) of sum(output * weight)."""
    x = x.detach().requires_grad_()
    out = model(x)
    out = out.to_local() if isinstance(out, DTensor) else out
    (out * weight).sum().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return out.detach(), x.grad, grads


def max_diff(a, b) -> float:
    pairs = [(a[0], b[0]), (a[1], b[1])] + [(a[2][n], b[2][n]) for n in a[2]]
    return max((u - v).abs().max().item() for u, v in pairs)


def check(rank: int, part: str, sp: bool, backend: str, fullgraph: bool, mesh) -> tuple[float, str]:
    torch.manual_seed(0)  # same weights and inputs on every rank
    ref = build(part)
    x, weight = torch.randn(B, T, DIM), torch.randn(B, T, DIM)
    if sp:  # each rank holds its slice of the sequence between blocks
        x, weight = x.chunk(2, dim=1)[rank], weight.chunk(2, dim=1)[rank]
    eager, compiled = build(part), build(part)
    for m in (eager, compiled):
        m.load_state_dict(ref.state_dict())
        styles = plan(part, sp)
        if "" in styles:
            parallelize_module(m, mesh, styles.pop(""))
        parallelize_module(m, mesh, styles)
    compiled.compile(backend=backend, fullgraph=fullgraph)
    torch._dynamo.reset()
    want = run_once(eager, x, weight)
    try:
        got = run_once(compiled, x, weight)
    except Exception as e:  # noqa: BLE001 - a failed backward is one of the outcomes we look for
        return float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    diff = torch.tensor(max_diff(want, got))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item(), ""


def worker(rank: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for part, sp, backend, fullgraph in itertools.product(args.parts, args.sp, args.backends, args.fullgraph):
        if part == "norm" and not sp:
            continue  # without sequence parallelism the norm is not parallelized
        diff, error = check(rank, part, bool(sp), backend, bool(fullgraph), mesh)
        if rank == 0:
            bad = bool(error) or not diff <= args.tol
            line = (f"part={part:9} sp={sp} backend={backend:9} fullgraph={fullgraph}  max|diff|={diff:.2e}  "
                    f"{'WRONG' if bad else 'ok'} {error}")
            print(line, flush=True)
            results.append(bad)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["block", "attention", "mlp", "norm"])
    p.add_argument("--sp", nargs="+", type=int, default=[0, 1])
    p.add_argument("--backends", nargs="+", default=["eager", "aot_eager", "inductor"])
    p.add_argument("--fullgraph", nargs="+", type=int, default=[0])
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    print(f"torch {torch.__version__}", flush=True)
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(worker, args=(args, results), nprocs=2)
        return 1 if any(results) else 0


if __name__ == "__main__":
    sys.exit(main())
