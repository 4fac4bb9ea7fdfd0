"""Peak memory and time of fused linear cross-entropy against the plain loss.

One forward + backward of each, in a fresh interpreter per variant (so neither inherits
the other's freed-but-kept memory), on the same seeded inputs:

- **plain**: `F.cross_entropy((hidden @ weight.T).float(), targets)`, then backward;
- **fused**: `forja.ops.fused_linear_cross_entropy(hidden, weight, targets)`, then
  backward (Triton for the per-chunk softmax on CUDA, PyTorch elsewhere);
- **fused-torch** (CUDA only): the same with the PyTorch per-chunk softmax, to see what
  the Triton kernels add.

hidden (tokens, dim) and weight (vocab, dim) require gradients; the ratios are against
`plain` measured in the same run. What is measured, all of it during forward + backward
only (the inputs exist before and are not counted):

- CPU: **peak RSS delta**, the process's resident-memory high-water mark (Linux VmHWM,
  reset just before through /proc/self/clear_refs) minus its resident memory at the
  start: everything the process touched, allocator slack included; and **allocator
  peak**, the highest point of the running sum of torch's CPU allocations and frees, as
  recorded by `torch.profiler` (profile_memory), as in bench/memory.py.
- CUDA: `torch.cuda.max_memory_allocated()` minus the memory allocated at the start,
  after one untimed warm-up pass (Triton compiles its kernels there).
- **time**: wall seconds of the forward + backward (CUDA: synchronized).

    python bench/memory_ce.py                            # 8192 x 2048 x 128256, fp32, CPU
    python bench/memory_ce.py --device cuda --dtype bfloat16
    python bench/memory_ce.py --chunk-size 2048          # fewer, larger chunks
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/profiling.py
from profiling import allocator_peak  # noqa: E402

GB = 1e9


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_rss_peak() -> bool:
    """Reset Linux's resident high-water mark (VmHWM); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def loss_fn(variant: str, chunk_size: int | None):
    if variant == "plain":
        return lambda h, w, t: F.cross_entropy((h @ w.T).float(), t)
    from forja.ops import fused_linear_cross_entropy

    backend = "torch" if variant == "fused-torch" else None
    return lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size, backend=backend)


def measure(ns: argparse.Namespace) -> dict:
    """One variant, in this (fresh) process."""
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(ns.tokens, ns.dim, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(ns.vocab, ns.dim, generator=g, device=device) * ns.dim ** -0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, ns.vocab, (ns.tokens,), generator=g, device=device)
    fn = loss_fn(ns.child, ns.chunk_size)

    def step() -> float:
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, targets)
        loss.backward()
        return loss.item()

    out = {"variant": ns.child}
    if device.type == "cuda":
        step()  # warm-up: Triton's compilation, cuBLAS's workspaces
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out["loss"] = step()
        torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - t0
        out["peak_bytes"] = torch.cuda.max_memory_allocated() - start
        return out
    from torch.profiler import ProfilerActivity, profile

    start = rss_bytes()
    out["hwm_reset"] = reset_rss_peak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        out["loss"] = step()
        out["seconds"] = time.perf_counter() - t0
    out["peak_bytes"] = rss_peak_bytes() - start
    out["allocator_peak_bytes"] = allocator_peak(prof)
    return out


def run_child(variant: str, ns: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--device", ns.device, "--dtype", ns.dtype,
           "--tokens", str(ns.tokens), "--dim", str(ns.dim), "--vocab", str(ns.vocab)]
    if ns.chunk_size:
        cmd += ["--chunk-size", str(ns.chunk_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="tokens per chunk of the fused loss (default: its own policy)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(measure(ns)))
        return
    variants = ["plain", "fused"] + (["fused-torch"] if ns.device == "cuda" else [])
    logits_gb = ns.tokens * ns.vocab * torch.finfo(getattr(torch, ns.dtype)).bits / 8 / GB
    from forja.ops.cross_entropy import chunk_rows

    chunk = ns.chunk_size or chunk_rows(ns.tokens, ns.vocab)
    print(f"{ns.tokens} tokens x {ns.dim} dim x {ns.vocab} vocab, {ns.dtype} on {ns.device}: full logits "
          f"{logits_gb:.2f} GB; fused chunks of {chunk} tokens; torch {torch.__version__}, "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    results = [run_child(v, ns) for v in variants]
    base = results[0]
    peak_name = "peak RSS delta GB" if ns.device == "cpu" else "peak allocated GB"
    extra = " | allocator peak GB" if ns.device == "cpu" else ""
    print(f"\n| variant | loss | {peak_name}{extra} | memory vs plain | s | time vs plain |")
    print("|---|---|---|---|---|---|" + ("---|" if extra else ""))
    for r in results:
        alloc = f" | {r['allocator_peak_bytes'] / GB:.2f}" if extra else ""
        print(f"| {r['variant']} | {r['loss']:.6f} | {r['peak_bytes'] / GB:.2f}{alloc} | "
              f"{r['peak_bytes'] / base['peak_bytes']:.3f} | {r['seconds']:.1f} | "
              f"{r['seconds'] / base['seconds']:.2f} |")
    saved = 1 - results[1]["peak_bytes"] / base["peak_bytes"]
    print(f"\nfused: {100 * saved:.1f}% lower peak memory than plain")
    if ns.device == "cpu" and not all(r["hwm_reset"] for r in results):
        print("note: VmHWM could not be reset; RSS peaks include the process's earlier high-water mark")


if __name__ == "__main__":
    main()
