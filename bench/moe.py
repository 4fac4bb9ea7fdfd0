"""Mixture of experts: training speed against a dense twin, grouped GEMM against a loop, EP memory.

Every ratio is against a baseline measured in the same run. Timed variants are interleaved
(one step of each in turn, medians of the rounds), so load from other processes on a
shared machine falls on all of them alike.

1. train: tokens/s of a forward + backward + AdamW step of qwen3 `debug-moe` against a dense
   qwen3 whose per-token active parameters (`num_active_params()`) equal the MoE's: the same
   args with `n_experts = 0` and the `ffn_dim` that makes the counts meet. Random tokens;
   the MoE once with each expert matmul (`moe_impl` grouped, loop). Baseline: dense.
2. grouped_mm: forward + backward of the routed experts (`GroupedExperts`: three grouped
   matmuls and SwiGLU, weights taking gradients) with `torch._grouped_mm` against one
   `F.linear` per expert, on tokens x top_k rows routed at random over E experts: a
   debug-moe layer, and a qwen3 30b-a3b layer (dim 2048, expert width 768, 128 experts,
   top 8) at a few hundred tokens. Baseline: loop.
3. ep_memory: qwen3 debug-moe built under expert parallelism over 1, 2, 4 Gloo ranks
   (meta -> `apply_ep` -> to_empty -> init_weights), one step taken; the bytes each rank
   holds, from the tensors (DTensors' local shards): routed experts' parameters, gradients
   and AdamW state, and the rest (replicated here: no FSDP). And the parameters of one 30b-a3b
   MoE layer built on the meta device under the same EP. Baseline: EP 1.

    python bench/moe.py                   # CPU, fp32, 1 thread: all three, 2-3 minutes on 2 cores
    python bench/moe.py --json out.json   # and the rows as JSON (--json alone: to stdout)
    python bench/moe.py --gpu             # one CUDA GPU, bf16: 1 and 2 at 30b-a3b shapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.models import build_from_args, model_args  # noqa: E402
from forja.models.common.moe import GroupedExperts, MoE, MoEArgs, moe_layers  # noqa: E402
from forja.models.common.transformer import next_token_loss  # noqa: E402
from forja.ops.grouped_mm import grouped_supported  # noqa: E402
from forja.testing import run_distributed  # noqa: E402

L30B = dict(dim=2048, hidden=768, experts=128, top_k=8)  # one qwen3 30b-a3b MoE layer
SIZES = {
    "cpu": dict(train=dict(flavor="debug-moe", overrides={}, batch=8, seq=256, warmup=3, steps=20),
                mm=[("debug-moe layer", dict(dim=128, hidden=64, experts=8, top_k=2, tokens=2048, repeats=20)),
                    ("30b-a3b layer", dict(L30B, tokens=256, repeats=5))],  # ~5 s a pass: 2.4 GB of weight gradients
                ep=[1, 2, 4]),
    # Two 30b-a3b blocks (full vocabulary) at 4096 tokens; the experts at a real micro-batch.
    "gpu": dict(train=dict(flavor="30b-a3b", overrides=dict(n_layers=2), batch=1, seq=4096, warmup=3, steps=10,
                           ffn_multiple=64),
                mm=[("30b-a3b layer", dict(L30B, tokens=16384, repeats=20))], ep=[]),
}
MB = 1e6


def _cpu_name() -> str:
    """The CPU's model name and core count (Linux's /proc/cpuinfo), for the table's header."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(steps: dict[str, Callable[[], None]], device: torch.device, warmup: int, repeats: int):
    """name -> median seconds of `repeats` rounds, each round one call of every step in turn."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


# -- 1. training step against a dense twin -------------------------------------------------

def dense_twin(family: str, flavor: str, overrides: dict, multiple: int = 1):
    """The dense args whose active parameters equal the MoE flavor's: the count is linear in
    ffn_dim, so two builds on the meta device give the line, and it is solved for ffn_dim
    (rounded to `multiple`: GPU matmuls slow down on widths that are not multiples of 64)."""
    target = build_from_args(model_args(family, flavor, **overrides), device="meta").num_active_params()

    def active(ffn_dim: int) -> int:
        args = model_args(family, flavor, **{**overrides, "n_experts": 0, "ffn_dim": ffn_dim})
        return build_from_args(args, device="meta").num_active_params()

    per_unit = active(2) - active(1)
    ffn_dim = multiple * round((1 + (target - active(1)) / per_unit) / multiple)
    return model_args(family, flavor, **{**overrides, "n_experts": 0, "ffn_dim": ffn_dim}), ffn_dim


def train_step(args, s: dict, device: torch.device, dtype: torch.dtype):
    """(the model, a closure running one forward + backward + AdamW step on fixed random tokens)."""
    model = build_from_args(args, device=device, seed=0, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab_size, (s["batch"], s["seq"] + 1), device=device,
                           generator=torch.Generator(device).manual_seed(0))

    def step() -> None:
        next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step


def bench_train(s: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    dense_args, ffn_dim = dense_twin("qwen3", s["flavor"], s["overrides"], s.get("ffn_multiple", 1))
    variants = {f"dense qwen3 (ffn_dim {ffn_dim})": dense_args}
    for impl in ("grouped", "loop"):
        variants[f"{s['flavor']} (moe_impl {impl})"] = model_args("qwen3", s["flavor"],
                                                                   **{**s["overrides"], "moe_impl": impl})
    built = {name: train_step(args, s, device, dtype) for name, args in variants.items()}
    medians = interleaved({n: step for n, (_, step) in built.items()}, device, s["warmup"], s["steps"])
    tokens = s["batch"] * s["seq"]
    base = tokens / medians[next(iter(medians))]
    rows = []
    for name, (model, _) in built.items():
        rows.append({"variant": name, "vs dense": tokens / medians[name] / base, "tokens/s": tokens / medians[name],
                     "ms/step": 1e3 * medians[name], "active params": model.num_active_params(),
                     "total params": model.num_params()})
    return rows


# -- 2. grouped matmul against the loop ------------------------------------------------------

def expert_problem(p: dict, device: torch.device, dtype: torch.dtype):
    """(experts module, rows sorted by expert (M, D), rows per expert): each token's top_k
    distinct experts drawn at random, as an untrained router sends them."""
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(p["experts"], p["dim"], p["hidden"]).to(device, dtype)
    gw = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        for w in experts.parameters():
            w.normal_(0, p["dim"] ** -0.5, generator=gw)
    chosen = torch.rand(p["tokens"], p["experts"], generator=g).topk(p["top_k"], dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=p["experts"]).to(device)
    x = torch.randn(p["tokens"] * p["top_k"], p["dim"], generator=g).to(device, dtype)
    return experts, x.requires_grad_(), counts


def experts_step(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, impl: str):
    """A closure: forward + backward of the experts with `impl`; returns the output."""
    def step() -> torch.Tensor:
        experts.impl = impl
        out = experts(x, counts)
        out.backward(torch.ones_like(out))
        experts.zero_grad(set_to_none=True)
        x.grad = None
        return out.detach()
    return step


def bench_grouped(problems: list, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Per problem: one untimed pass of each (warm-up, and the two outputs compared), then
    `repeats` interleaved rounds."""
    rows = []
    for label, p in problems:
        problem = expert_problem(p, device, dtype)  # one set of weights for both
        steps = {impl: experts_step(*problem, impl) for impl in ("grouped", "loop")}
        diff = (steps["grouped"]().float() - steps["loop"]().float()).abs().max().item()
        medians = interleaved(steps, device, 0, p["repeats"])
        shape = (f"{p['tokens']} tokens x top-{p['top_k']} of {p['experts']} experts, dim {p['dim']}, "
                 f"width {p['hidden']}")
        rows.append({"problem": f"{label}: {shape}, median of {p['repeats']}",
                     "grouped speed-up": medians["loop"] / medians["grouped"],
                     "ms grouped": 1e3 * medians["grouped"], "ms loop": 1e3 * medians["loop"],
                     "max |grouped - loop|": diff})
    return rows


# -- 3. memory per rank under expert parallelism --------------------------------------------

def _local_bytes(tensors) -> int:
    """Bytes of the tensors as this rank holds them (a DTensor: its local shard)."""
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors if t is not None)


def _ep_worker(rank: int, world: int) -> dict:
    from forja.parallel.degrees import Degrees
    from forja.parallel.dims import ParallelDims
    from forja.parallel.ep import apply_ep

    torch.set_num_threads(1)  # several ranks share the cores
    ep_mesh = None
    if world > 1:
        dims = ParallelDims(Degrees(dp_shard=world, ep=world))
        dims.build_mesh("cpu")
        ep_mesh = dims.ep_mesh
    args = model_args("qwen3", "debug-moe")
    model = build_from_args(args, device="meta")  # the build order: shard on meta, then allocate
    if ep_mesh is not None:
        apply_ep(model, ep_mesh)
    model = model.to_empty(device="cpu")
    model.init_weights(0)
    # foreach=False: the experts are DTensors, the rest plain tensors, and foreach wants one kind.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, args.vocab_size, (4, 129), generator=torch.Generator().manual_seed(rank))
    next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    routed = {id(p) for _, moe in moe_layers(model) for p in moe.experts.parameters()}
    out = {}
    for kind, params in (("expert", [p for p in model.parameters() if id(p) in routed]),
                         ("other", [p for p in model.parameters() if id(p) not in routed])):
        out[f"{kind} params"] = _local_bytes(params)
        out[f"{kind} grads"] = _local_bytes(p.grad for p in params)
        out[f"{kind} adamw"] = _local_bytes(v for p in params for v in opt.state[p].values())
    with torch.device("meta"):  # a 30b-a3b layer: 604 M expert parameters, never allocated
        layer = MoE(L30B["dim"], MoEArgs(n_experts=L30B["experts"], top_k=L30B["top_k"], moe_ffn_dim=L30B["hidden"]))
    if ep_mesh is not None:
        apply_ep(layer, ep_mesh)
    out["30b-a3b layer expert params"] = _local_bytes(layer.experts.parameters())
    return out


def bench_ep(worlds: list[int]) -> list[dict]:
    rows, base = [], None
    for world in worlds:
        per_rank = run_distributed(_ep_worker, world, timeout_s=300)
        r = {k: max(rank[k] for rank in per_rank) for k in per_rank[0]}  # the most loaded rank
        expert = r["expert params"] + r["expert grads"] + r["expert adamw"]
        whole = expert + r["other params"] + r["other grads"] + r["other adamw"]
        base = base or (expert, whole, r["30b-a3b layer expert params"])
        rows.append({"EP": world, "expert share EP1/EPn": base[0] / expert, "whole rank EP1/EPn": base[1] / whole,
                     "expert p+g+adamw MB/rank": expert / MB,
                     "(p, g, adamw)": f"{r['expert params'] / MB:.3f}, {r['expert grads'] / MB:.3f}, "
                                      f"{r['expert adamw'] / MB:.3f}",
                     "non-expert p+g+adamw MB/rank": (whole - expert) / MB, "whole rank MB": whole / MB,
                     "30b-a3b layer expert params MB/rank": r["30b-a3b layer expert params"] / MB,
                     "30b-a3b EP1/EPn": base[2] / r["30b-a3b layer expert params"]})
    return rows


# -- output -----------------------------------------------------------------------------------

def _cell(key: str, v) -> str:
    if isinstance(v, float) and ("vs" in key or "speed-up" in key or "EP1/EPn" in key):
        return f"**{v:.2f}x**"  # the ratios, in bold as the other RESULTS.md tables have them
    if isinstance(v, float):
        return f"{v:.1e}" if key.startswith("max |") else f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def print_table(title: str, rows: list[dict], file=None) -> None:
    print(f"\n## {title}\n", file=file)
    print("| " + " | ".join(rows[0]) + " |", file=file)
    print("|" + "---|" * len(rows[0]), file=file)
    for r in rows:
        print("| " + " | ".join(_cell(k, v) for k, v in r.items()) + " |", file=file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, bf16, 30b-a3b shapes")
    parser.add_argument("--sections", nargs="+", default=["train", "grouped_mm", "ep_memory"],
                        choices=["train", "grouped_mm", "ep_memory"])
    # One thread by default: on this shared 2-core machine, with 2 OpenMP threads a step took
    # 0.35 to 8.8 s as other processes came and went; with one, within 30% of each other.
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for the timed sections")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write every row as JSON to PATH (or stdout)")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    out = sys.stderr if ns.json == "-" else sys.stdout  # --json alone: stdout holds only the JSON
    if ns.gpu and not torch.cuda.is_available():
        raise SystemExit(f"--gpu: no CUDA GPU here (torch {torch.__version__} sees none)")
    device, dtype = (torch.device("cuda"), torch.bfloat16) if ns.gpu else (torch.device("cpu"), torch.float32)
    s = SIZES["gpu" if ns.gpu else "cpu"]
    machine = torch.cuda.get_device_name() if ns.gpu else _cpu_name()
    probe = torch.ones(16, 16, device=device, dtype=dtype)
    auto = "grouped" if grouped_supported(probe, probe.expand(2, 16, 16)) else "loop"
    print(f"# bench/moe.py on {machine}, threads: {torch.get_num_threads()}; torch {torch.__version__}, {dtype}; "
          f"moe_impl auto picks {auto} here", file=out)
    results = {"machine": machine, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "dtype": str(dtype), "auto": auto, "sizes": s}
    if "train" in ns.sections:
        results["train"] = bench_train(s["train"], device, dtype)
        print_table(f"train step: forward + backward + AdamW, {s['train']['batch']} x {s['train']['seq']} tokens, "
                    f"median of {s['train']['steps']}", results["train"], out)
    if "grouped_mm" in ns.sections:
        results["grouped_mm"] = bench_grouped(s["mm"], device, dtype)
        print_table("routed experts forward + backward", results["grouped_mm"], out)
    if "ep_memory" in ns.sections and s["ep"]:
        results["ep_memory"] = bench_ep(s["ep"])
        print_table("bytes per rank under expert parallelism (Gloo, after one AdamW step)", results["ep_memory"], out)
    if ns.json:
        text = json.dumps(results, indent=1, default=str)
        if ns.json == "-":
            print(text)
        else:
            Path(ns.json).write_text(text)


if __name__ == "__main__":
    main()
