"""Microbenchmarks that calibrate `forja plan`'s speed model (forja/plan/speed.py) on this
machine, disjoint from the published runs it is validated against (bench/plan_published.py):

- matmul efficiency by shape: achieved / peak TFLOP/s of the GEMMs of a transformer layer
  (forward, and backward's two: input gradient and weight gradient), for a model flavor's
  widths and a micro-batch of tokens; compare with speed.GEMM_EFFICIENCY x the size factor;
- attention: causal SDPA forward + backward, achieved / peak on the causal FLOPs (speed.
  ATTENTION_EFFICIENCY);
- memory bandwidth: a large copy, achieved / datasheet (speed.HBM_EFFICIENCY);
- collectives by message size: all-gather, reduce-scatter, all-reduce bus bandwidth as
  nccl-tests defines it (algbw x (n-1)/n, all-reduce x 2(n-1)/n), against the hardware
  table's intra-node figure (run under torchrun --nproc-per-node 8 for a node's NVLink).

    python bench/calibrate.py --tiny                       # CPU: tiny shapes, 2 Gloo ranks, prints the table
    python bench/calibrate.py --flavor 3.1-8b --tokens 8192   # one GPU
    torchrun --nproc-per-node 8 bench/calibrate.py --collectives-only

The peak is the hardware table's for this device (forja/plan/hardware.py); a device the table
does not know prints "unknown peak" and only absolute figures. Results go to stdout as markdown
(paste into bench/RESULTS.md with the date, machine and command).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.models import model_args  # noqa: E402
from forja.plan.hardware import Hardware, get_hardware, hardware_for_device  # noqa: E402
from forja.plan.speed import ATTENTION_EFFICIENCY, HBM_EFFICIENCY, matmul_efficiency  # noqa: E402


def device_and_hardware() -> tuple[torch.device, Hardware]:
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        props = torch.cuda.get_device_properties(dev)
        return dev, hardware_for_device(props.name, props.total_memory)
    return torch.device("cpu"), get_hardware("cpu")


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def layer_gemms(flavor: str, tokens: int, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of one block's GEMMs and the output projection, per TP rank."""
    a = model_args("llama", flavor)
    q, kv, f = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp, a.ffn_dim // tp
    return [("qkv", tokens, a.dim, q + 2 * kv), ("wo", tokens, q, a.dim), ("w1+w3", tokens, a.dim, 2 * f),
            ("w2", tokens, f, a.dim), ("output", tokens, a.dim, a.vocab_size // tp)]


def gemm_rows(args, device: torch.device, hw: Hardware, dtype: torch.dtype) -> list[list[str]]:
    peak = hw.bf16_flops if dtype == torch.bfloat16 else hw.fp32_flops
    rows = []
    for name, m, k, n in layer_gemms(args.flavor, args.tokens, args.tp):
        x, w, g = (torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype),
                   torch.randn(m, n, device=device, dtype=dtype))
        for part, (a, b) in (("forward", (x, w)), ("input grad", (g, w.T)), ("weight grad", (x.T, g))):
            achieved = 2 * m * k * n / timed(lambda a=a, b=b: a @ b, device, args.reps)
            model = matmul_efficiency(m, min(k, n), hw)
            rows.append([f"{name} {part}", f"{m}x{k}x{n}", f"{achieved / 1e12:.4g}", _ratio(achieved, peak),
                         f"{model:.3f}" if hw.peak_known else "-"])
        del x, w, g
    return rows


def attention_row(args, device: torch.device, hw: Hardware, dtype: torch.dtype) -> list[str]:
    a = model_args("llama", args.flavor)
    heads, seq = a.n_heads // args.tp, args.tokens
    q, k, v = (torch.randn(1, heads, seq, a.head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (1, H, T, hd)
        out.backward(torch.ones_like(out))

    flops = 3 * 4 * seq * seq * heads * a.head_dim / 2  # forward + backward, causal half
    achieved = flops / timed(step, device, args.reps)
    peak = hw.bf16_flops if dtype == torch.bfloat16 else hw.fp32_flops
    return ["causal SDPA fwd+bwd", f"H {heads}, T {seq}, d {a.head_dim}", f"{achieved / 1e12:.4g}",
            _ratio(achieved, peak), f"{ATTENTION_EFFICIENCY:.3f}"]


def copy_row(args, device: torch.device, hw: Hardware) -> list[str]:
    n = args.copy_mib * 2**20 // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    achieved = 2 * n * 4 / timed(lambda: dst.copy_(src), device, args.reps)  # read + write
    return ["copy", f"{args.copy_mib} MiB", f"{achieved / 1e9:.1f} GB/s", _ratio(achieved, hw.hbm_bytes_per_s),
            f"{HBM_EFFICIENCY:.3f}"]


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _ratio(achieved: float, peak: float) -> str:
    return f"{achieved / peak:.4g}" if peak > 0 else "unknown peak"


def collective_rows(args, device: torch.device, hw: Hardware) -> list[list[str]]:
    """Bus bandwidth of the three FSDP/TP collectives by message size, on this process group."""
    import warnings

    import torch.distributed as dist

    # torch 2.13 renames these two (all_gather_single, reduce_scatter_single); 2.11 has only the old names.
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    n, rows = dist.get_world_size(), []
    for size in args.message_bytes:
        elements = max(n, size // 2 // n * n)  # bf16 elements, divisible by the ranks
        full = torch.zeros(elements, dtype=torch.bfloat16, device=device)
        shard = torch.zeros(elements // n, dtype=torch.bfloat16, device=device)
        ops = {"all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (n - 1) / n),
               "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
               "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n)}
        for name, (fn, factor) in ops.items():
            seconds = timed(fn, device, args.reps)
            bus = elements * 2 / seconds * factor
            rows.append([name, _size(elements * 2), f"{n}", f"{bus / 1e9:.2f}",
                         _ratio(bus, hw.intra_node_bytes_per_s)])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _collectives_worker(rank: int, world: int, port: int, args) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = collective_rows(args, torch.device("cpu"), get_hardware("cpu"))
        if rank == 0:
            print(table(["collective", "message", "ranks", "bus GB/s", "bus / table's intra-node"], rows), flush=True)
    finally:
        dist.destroy_process_group()


def run_collectives(args, device: torch.device, hw: Hardware) -> None:
    import torch.distributed as dist

    if "RANK" in os.environ:  # under torchrun: this group, NCCL on GPUs
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        try:
            rows = collective_rows(args, device, hw)
            if dist.get_rank() == 0:
                print(table(["collective", "message", "ranks", "bus GB/s", "bus / table's intra-node"], rows))
        finally:
            dist.destroy_process_group()
        return
    from forja.testing import free_port

    torch.multiprocessing.spawn(_collectives_worker, args=(args.ranks, free_port(), args), nprocs=args.ranks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized shapes and few repetitions (a smoke run)")
    p.add_argument("--flavor", default="3.1-8b", help="a Llama flavor whose layer shapes are timed")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one micro-batch (the GEMMs' M)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree the widths are split by")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2, help="local Gloo ranks for collectives when not under torchrun")
    p.add_argument("--message-bytes", type=int, nargs="+", default=[2**20, 2**24, 2**28])
    p.add_argument("--collectives-only", action="store_true")
    p.add_argument("--no-collectives", action="store_true", help="kernels and memory only (one process)")
    args = p.parse_args(argv)
    if args.tiny:
        args.flavor, args.tokens, args.reps, args.copy_mib = "debug", 64, 3, 16
        args.message_bytes = [2**12, 2**16]
    device, hw = device_and_hardware()
    print(f"device: {hw.name} ({hw.kind}); peaks from forja/plan/hardware.toml"
          + ("" if hw.peak_known else ": unknown peak, absolute figures only"))
    if not args.collectives_only and int(os.environ.get("RANK", 0)) == 0:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        rows = gemm_rows(args, device, hw, dtype) + [attention_row(args, device, hw, dtype)]
        print(table(["kernel", "shape", "achieved TFLOP/s", "achieved / peak", "speed model's"], rows))
        print(table(["memory", "size", "achieved", "achieved / datasheet", "speed model's"],
                    [copy_row(args, device, hw)]))
    if not args.no_collectives:
        run_collectives(args, device, hw)


if __name__ == "__main__":
    main()
