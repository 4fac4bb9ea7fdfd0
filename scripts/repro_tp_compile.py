"""Does `torch.compile` of a tensor-parallel (DTensor) module give eager's gradients?

    python scripts/repro_tp_compile.py                   # the default grid: 2 ranks, Gloo, CPU
    python scripts/repro_tp_compile.py --parts mlp --sp 1 --backends aot_eager --inputs async

forja/parallel/checks.py refuses parallel.compile with parallel.tp > 1 where this script
finds a wrong gradient. Self-contained on public torch APIs, so it runs in any venv: a
tiny Llama block (RMSNorm -> attention -> RMSNorm -> SwiGLU, residual adds) behind a
token embedding, both with forja's TP plan (forja/models/common/tp_plan.py); the same
weights and tokens run eagerly and with the block (or one part of it) compiled in place,
as forja's per-block compile does. What goes into the compiled module is one dimension:
"async" is the embedding's output as RowwiseParallel returns it, an AsyncCollectiveTensor
(the collective not yet waited on; forja's first block gets exactly that), "plain" is the
same value materialized outside the compiled module (what every later block gets).
One line per configuration; exit status 1 when an output or a gradient differs by more
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

B, T, DIM, HEADS, FFN, VOCAB = 2, 8, 32, 4, 64, 64


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))

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
        self.w1, self.w3, self.w2 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention, self.ffn_norm, self.feed_forward = RMSNorm(), Attention(), RMSNorm(), MLP()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Double(nn.Module):
    """No parameters, no DTensor: shows that the input's kind alone decides."""

    def forward(self, x):
        return 2 * x


# part -> (its name in the block plan: "" the whole block, None no style at all; module)
PARTS = {"block": ("", Block), "attention": ("attention", Attention), "mlp": ("feed_forward", MLP),
         "norm": ("attention_norm", RMSNorm), "double": (None, Double)}


def block_plan(sp: bool) -> dict:
    """forja's plan of one block (forja/models/common/tp_plan.py, dense_tp_plan)."""
    seq = Shard(1) if sp else Replicate()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": gather, "feed_forward": gather})
    return plan


def build(part: str) -> nn.Module:
    """embedding -> `part`, on one device."""
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(VOCAB, DIM))
    model.add_module("part", PARTS[part][1]())
    return model


def parallelize(model: nn.Module, part: str, sp: bool, mesh) -> nn.Module:
    """forja's embedding style, and the part's slice of the block plan re-keyed under
    "part" (the part's own style, such as the SP gather, is keyed by the bare prefix)."""
    prefix = PARTS[part][0]
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())}
    for name, style in block_plan(sp).items():
        if prefix is None:
            continue
        if not prefix:
            plan["part." + name] = style
        elif name == prefix or name.startswith(prefix + "."):
            plan["part" + name[len(prefix):]] = style
    return parallelize_module(model, mesh, plan)


def run(model: nn.Module, tokens: torch.Tensor, weight: torch.Tensor, plain: bool) -> dict:
    """{"output" and each parameter's name: its full gradient (None if missing)} of sum(output * weight)."""
    x = model.embed(tokens)
    if plain:  # clone() waits for the collective: the compiled module gets an ordinary tensor
        x = x.clone()
    out = model.part(x)
    out = out.to_local() if isinstance(out, DTensor) else out
    (out * weight).sum().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return {"output": out.detach(), **grads}


def check(rank: int, mesh, part: str, sp: bool, backend: str, fullgraph: bool, plain: bool) -> tuple[float, str]:
    """Max |eager - compiled| over the output and the gradients, all ranks; or the error."""
    torch.manual_seed(0)  # the same weights, tokens and output weights on every rank
    state = build(part).state_dict()
    tokens, weight = torch.randint(0, VOCAB, (B, T)), torch.randn(B, T, DIM)
    if sp:  # the module's output is this rank's slice of the sequence
        weight = weight.chunk(2, dim=1)[rank]
    eager, compiled = build(part), build(part)
    for model in (eager, compiled):
        model.load_state_dict(state)
        parallelize(model, part, sp, mesh)
    compiled.part.compile(backend=backend, fullgraph=fullgraph)  # in place, as forja compiles each block
    torch._dynamo.reset()
    want = run(eager, tokens, weight, plain)
    try:
        got = run(compiled, tokens, weight, plain)
    except Exception as e:  # noqa: BLE001 - a backward that raises is one of the outcomes looked for
        return float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"
    missing = [n for n in want if got[n] is None]
    diff = torch.tensor(max((want[n] - got[n]).abs().max().item() for n in want if n not in missing))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item(), f"no gradient for {', '.join(missing)}" if missing else ""


def worker(rank: int, args: argparse.Namespace, failed) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    grid = itertools.product(args.parts, args.sp, args.inputs, args.backends, args.fullgraph)
    for part, sp, inputs, backend, fullgraph in grid:
        if part == "norm" and not sp:
            continue  # without sequence parallelism the norms are not parallelized
        diff, error = check(rank, mesh, part, bool(sp), backend, bool(fullgraph), inputs == "plain")
        if rank == 0:
            bad = bool(error) or not diff <= args.tol
            print(f"part={part:9} sp={sp} input={inputs:5} backend={backend:9} fullgraph={fullgraph}  "
                  f"max|diff|={diff:8.2e}  {'WRONG' if bad else 'ok'} {error}", flush=True)
            failed.append(bad)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--sp", nargs="+", type=int, choices=[0, 1], default=[0, 1], help="sequence parallelism")
    p.add_argument("--inputs", nargs="+", choices=["async", "plain"], default=["async", "plain"])
    p.add_argument("--backends", nargs="+", default=["eager", "aot_eager", "inductor"])
    p.add_argument("--fullgraph", nargs="+", type=int, choices=[0, 1], default=[0])
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    print(f"torch {torch.__version__}", flush=True)
    with mp.Manager() as manager:
        failed = manager.list()
        mp.spawn(worker, args=(args, failed), nprocs=2)
        return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
