"""Fused kernels against PyTorch: forward + backward time of rms_norm, rope and swiglu.

For each op, four variants of the same computation, measured side by side in one process:
- eager: the PyTorch reference (forja.ops.<op>_reference), op by op;
- compile: `torch.compile` of that reference (Inductor generates its own Triton kernels);
- forja: forja.ops' Triton kernels;
- liger: Liger Kernel's equivalent (linkedin/Liger-Kernel), when `liger_kernel` imports.

On CUDA (bf16, Llama 3.2-1B shapes: 8192 tokens as 2 x 4096, dim 2048, hidden 8192, 32 query
and 8 key/value heads of 64): each variant is warmed up (compiling included), then timed
`--repeats` times with CUDA events around forward + backward; the median is reported.
Without CUDA it is a smoke run at tiny sizes with eager and compile only (Triton's
interpreter is not a speed), to show the script works.

    python bench/kernel_speed.py                 # CUDA if present, else the CPU smoke run
    python bench/kernel_speed.py --tiny          # tiny sizes even on a GPU

`run(device, sizes)` returns the table's rows (bench/gpu.py calls it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.ops import rms_norm, rope, swiglu, use_triton  # noqa: E402
from forja.ops.rms_norm import rms_norm_reference  # noqa: E402
from forja.ops.rope import rope_reference  # noqa: E402
from forja.ops.swiglu import swiglu_reference  # noqa: E402

SIZES = {
    "llama-1b": dict(batch=2, seq=4096, dim=2048, hidden=8192, heads=32, kv_heads=8, head_dim=64,
                     warmup=5, repeats=50),
    "tiny": dict(batch=2, seq=64, dim=64, hidden=256, heads=4, kv_heads=2, head_dim=16, warmup=3, repeats=10),
}
EPS = 1e-5


def _liger():
    """Liger Kernel's autograd Functions for the three ops, or None when it does not import."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return None
    return {
        # casting_mode "llama": float32 statistics, normalized row cast back before the weight (forja's).
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama"),
        # Liger takes q, k as (B, heads, T, hd) and rotates them in place; its cos/sin are (T, hd).
        "rope": lambda q, k, cos, sin: LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
        "swiglu": LigerSiLUMulFunction.apply,
    }


def _inputs(op: str, s: dict, device: torch.device, dtype: torch.dtype) -> tuple[list, list]:
    """(tensor inputs that take gradients, constant inputs) of one op at sizes `s`."""
    tokens = s["batch"] * s["seq"]
    if op == "rms_norm":
        return [torch.randn(tokens, s["dim"], device=device, dtype=dtype),
                torch.ones(s["dim"], device=device, dtype=dtype)], []
    if op == "rope":
        B, T, hd = s["batch"], s["seq"], s["head_dim"]
        angles = torch.arange(T, device=device).float()[:, None] * torch.rand(hd // 2, device=device)
        angles = torch.cat((angles, angles), -1)  # (T, hd)
        return [torch.randn(B, T, s["heads"], hd, device=device, dtype=dtype),
                torch.randn(B, T, s["kv_heads"], hd, device=device, dtype=dtype)], [angles.cos(), angles.sin()]
    return [torch.randn(tokens, s["hidden"], device=device, dtype=dtype) for _ in range(2)], []


def _variants(op: str, device: torch.device) -> dict[str, Callable | str]:
    """name -> function of (trainable..., constants...), or a note saying why it is not run."""
    reference = {"rms_norm": lambda x, w: rms_norm_reference(x, w, EPS), "rope": rope_reference,
                 "swiglu": swiglu_reference}[op]
    fused = {"rms_norm": lambda x, w: rms_norm(x, w, EPS), "rope": rope, "swiglu": swiglu}[op]
    variants: dict[str, Callable | str] = {"eager": reference, "compile": torch.compile(reference, dynamic=False)}
    if device.type != "cuda":
        return variants
    probe = torch.ones(1, device=device)
    variants["forja"] = fused if use_triton(probe) else "forja's kernels are off (FORJA_OPS or no triton)"
    liger = _liger()
    variants["liger"] = liger[op] if liger else "liger-kernel does not import"
    return variants


def _fwd_bwd(fn: Callable, trainable: list, constants: list) -> Callable[[], None]:
    def step():
        out = fn(*trainable, *constants)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(out, trainable, [torch.ones_like(o) for o in out])

    return step


def _median_ms(step: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(device: torch.device | str, sizes: str | dict = "llama-1b") -> list[dict]:
    """Rows {op, variant, ms fwd+bwd, vs eager, note} for every op and variant.

    `sizes`: a name of SIZES or a dict like its entries. Off CUDA the run is a smoke run
    (a name means tiny sizes there; float32, eager and compile only)."""
    device = torch.device(device)
    smoke = device.type != "cuda"
    s = SIZES["tiny" if smoke else sizes] if isinstance(sizes, str) else sizes
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for op in ("rms_norm", "rope", "swiglu"):
        torch.manual_seed(0)
        trainable, constants = _inputs(op, s, device, dtype)
        trainable = [t.requires_grad_() for t in trainable]
        eager_ms = None
        for name, fn in _variants(op, device).items():
            row = {"op": op, "variant": name, "ms fwd+bwd": None, "vs eager": None,
                   "note": "CPU smoke run, not a speed" if smoke else ""}
            if isinstance(fn, str):
                row["note"] = fn
            else:
                try:
                    ms = _median_ms(_fwd_bwd(fn, trainable, constants), device, s["warmup"], s["repeats"])
                except Exception as e:  # one variant failing (say, no C++ compiler for Inductor) is a note
                    row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                else:
                    eager_ms = ms if name == "eager" else eager_ms
                    row["ms fwd+bwd"] = ms
                    row["vs eager"] = eager_ms / ms if eager_ms else None
            rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| op | variant | ms fwd+bwd | speed-up vs eager | note |")
    print("|---|---|---|---|---|")
    for r in rows:
        ms = "n/a" if r["ms fwd+bwd"] is None else f"{r['ms fwd+bwd']:.3f}"
        speedup = "n/a" if r["vs eager"] is None else f"{r['vs eager']:.2f}x"
        print(f"| {r['op']} | {r['variant']} | {ms} | {speedup} | {r['note']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes even on a GPU")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (median reported)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = dict(SIZES["tiny" if args.tiny or device.type != "cuda" else "llama-1b"])
    if args.repeats:
        sizes["repeats"] = args.repeats
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: eager and compile only)"
    print(f"# fused kernels, forward + backward, on {name}; torch {torch.__version__}")
    print(f"# sizes: {sizes}\n")
    print_rows(run(device, sizes))


if __name__ == "__main__":
    main()
