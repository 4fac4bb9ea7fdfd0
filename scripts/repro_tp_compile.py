"""Does `torch.compile` of a tensor-parallel (DTensor) module give eager's gradients?

    python scripts/repro_tp_compile.py                          # the whole grid: ~12 min on 2 cores
    python scripts/repro_tp_compile.py --parts block --backends aot_eager        # the bug: ~20 s
    python scripts/repro_tp_compile.py --parts block --backends aot_eager --inputs plain  # exit 0

Self-contained on public torch APIs, so it runs in any venv: 2 ranks, Gloo, CPU, fp32. A
token embedding feeds a tiny Llama block (RMSNorm -> attention -> RMSNorm -> SwiGLU,
residual adds); both get forja's TP plan for Llama (the dense plan, forja/models/common/tp_plan.py),
and the same weights and tokens run eagerly and with the block, or one part of it,
compiled in place as forja compiles each block. One line per configuration; exit status 1
when an output or a gradient differs by more than --tol, is missing, or the run raised.

What goes into the compiled module decides. "async": the embedding's output as
RowwiseParallel returns it, an AsyncCollectiveTensor (its all-reduce or reduce-scatter not
yet waited on): what forja's first block gets. "plain": the same value materialized outside
the compiled module by a clone(): what every later block gets. On torch 2.13.0 and 2.14.1
every "async" configuration goes wrong under AOTAutograd (aot_eager, inductor; not
backend="eager"), with or without sequence parallelism, fullgraph or not, and even for
`double`, a module with no parameters and no DTensor; every "plain" one is right. AOTAutograd
waits on such inputs before tracing (torch/_functorch/_aot_autograd/frontend_utils.py,
process_inputs) and keeps the waited tensor, which does not require grad, so the gradient
to whatever produced the input is dropped: backward raises, or the embedding's gradient is
silently missing (wrong, when the embedding is tied to the output projection).

forja therefore clones the embedding's output before the first block whenever TP and
compile meet (`wait_for_embedding_output` in forja/parallel/tp.py), which is the "plain"
case; the layout "FSDP 2 x TP 2 + SP + compile" in tests/distributed/test_parity.py checks
the whole model against one process (without the clone it is 2.5e-3 off after 10 steps).
Run this script on a new torch to see whether the clone is still needed.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

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
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(), MLP()

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
    """forja's plan of one block."""
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
    return nn.Sequential(OrderedDict(embed=nn.Embedding(VOCAB, DIM), part=PARTS[part][1]()))


def parallelize(model: nn.Module, part: str, sp: bool, mesh) -> nn.Module:
    """forja's embedding style, and the part's slice of the block plan re-keyed under
    "part" (the part's own style, such as the SP gather, is keyed by the bare prefix)."""
    prefix = PARTS[part][0]
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())}
    for name, style in block_plan(sp).items() if prefix is not None else ():
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
    # A rank that raises where the other does not would leave it waiting: fail in minutes.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=5))
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
