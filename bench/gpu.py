"""The GPU benchmark: training steps, fused kernels and attention, each against its baseline.

Every ratio is against a baseline measured side by side in the same run.

    python bench/gpu.py --size check    # what `make gpu-check` runs, sized for ~5 minutes on one H200
    python bench/gpu.py --size full     # Llama 3.2 1B as the llama3-1b recipe trains it (micro-batch 4)
    python bench/gpu.py --size tiny     # anywhere (CPU): tiny sizes, to show the script works

Sections, one table row per figure, each with its ratio to the section's baseline:
1. train: `StepEngine.train_step`, the very call the trainer makes (zero_grad, forward and
   backward, clipping, AdamW and schedule steps), of Llama 3.2-1B (bf16 parameters, FSDP
   degree 1, synthetic tokens in 4 documents, document mask) for eager / compile / compile +
   fused ops / + float8: tokens/s of the median step, MFU, peak memory, the last loss (the same
   batch every step, so the variants' losses are comparable) and the first step's time
   (compilation included); baseline: eager.
2. kernels: each fused kernel, forward + backward, against PyTorch eager, torch.compile and
   Liger Kernel (bench/kernel_speed.py); baseline: eager.
3. attention: FlexAttention with a document mask and SDPA with a dense document mask,
   against SDPA causal (flash) at the same sequence length; baseline: SDPA causal.

A variant whose dependency is missing (torchao for float8, liger-kernel) or that fails is a
row saying so; the rest still run. `--jsonl PATH` appends each row as soon as it is measured
(bench/gpu_check.py reads them, also after a timeout); `--budget-s S` turns whatever would
start after S seconds into a "skipped" row, so a run fits a time limit.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/kernel_speed.py

from forja.metrics.throughput import memory_stats, peak_flops  # noqa: E402
from forja.models import build_from_args, model_args  # noqa: E402
from forja.models.common.attention import attend, build_mask  # noqa: E402
from forja.ops.names import FUSED_OPS  # noqa: E402
from forja.optim import OptimizerGroup, SchedulerGroup  # noqa: E402
from forja.optim.config import OptimConfig, ScheduleConfig  # noqa: E402
from forja.parallel import ParallelConfig, ParallelDims  # noqa: E402
from forja.parallel.process_group import init_distributed, shutdown_distributed  # noqa: E402
from forja.train.build import build_model_parts  # noqa: E402
from forja.train.step.build import build_engine  # noqa: E402

VARIANTS = {  # name -> (parallel.compile, model.fused_ops, train.float8)
    "eager": (False, False, "none"),
    "compile": (True, False, "none"),
    "compile + fused ops": (True, True, "none"),
    "compile + fused ops + float8": (True, True, "tensorwise"),
}
SECTIONS = ("train", "kernels", "attention")
_1B = dict(flavor="3.2-1b", overrides={}, seq=4096, attention="flex", float8_min_features=1024, kernels="llama-1b")
SIZES = {
    # The `debug` Llama: runs anywhere in a minute or two; not a speed.
    "tiny": dict(flavor="debug", overrides={"tie_embeddings": False}, seq=128, micro=2, warmup=2, steps=3,
                 attention="sdpa", float8_min_features=0, kernels="tiny", kernel_repeats=10),
    # Compilation dominates (an estimated 20-60 s per compiled variant on an H200), so few steps.
    "check": dict(_1B, micro=2, warmup=2, steps=6, kernel_repeats=20),
    "full": dict(_1B, micro=4, warmup=3, steps=10, kernel_repeats=50),
}


def row(section: str, what: str, figure: str = "", vs: str = "", note: str = "", **data) -> dict:
    """One line of the results table; `data` keeps the raw numbers for other scripts."""
    return dict(section=section, what=what, figure=figure, vs=vs, note=note, data=data)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _failure(e: BaseException) -> str:
    traceback.print_exc()  # the whole story goes to the log; the table gets one line
    first = (str(e).strip().splitlines() or [""])[0]
    return f"failed: {type(e).__name__}: {first[:160]}"


def _late() -> str:
    return "out of the time budget (--budget-s)"


def _free(device: torch.device) -> None:
    """Forget the last variant: its memory and its compiled graphs (each variant compiles afresh)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class Batch:
    """A micro-batch as the engine takes it: (B, T) input ids, labels and document ids."""

    def __init__(self, tokens: torch.Tensor, doc_ids: torch.Tensor):
        self.input_ids, self.labels, self.document_ids = tokens[:, :-1], tokens[:, 1:], doc_ids


def synthetic_batch(vocab: int, micro: int, seq: int, device: torch.device, docs: int = 4) -> Batch:
    tokens = torch.randint(0, vocab, (micro, seq + 1), device=device)
    doc_ids = (torch.arange(seq, device=device) * docs // seq).expand(micro, seq)  # `docs` equal documents
    return Batch(tokens, doc_ids)


# -- 1. training steps ---------------------------------------------------------------------
def _unavailable(name: str, device: torch.device) -> str | None:
    """Why variant `name` cannot run here, or None."""
    if VARIANTS[name][2] == "none":
        return None
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (scripts/gpu_wheels.sh downloads its wheel into .whl/)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"float8 matmuls need compute capability 8.9 or newer; this GPU has {major}.{minor}"
    return None


def _engine(name: str, s: dict, device: torch.device, dims: ParallelDims):
    """The model, optimizer, schedule and step engine of variant `name`, built as the trainer
    builds them (forja/train/trainer.py's setup)."""
    compile_, fused, float8 = VARIANTS[name]
    args = model_args("llama", s["flavor"], fused_ops=FUSED_OPS if fused else (), attention=s["attention"],
                      **s["overrides"])
    cfg = ParallelConfig(compile=compile_, mixed_precision="bf16" if device.type == "cuda" else "fp32")
    built = build_model_parts(args, dims, cfg, device=device, seed=0, seq_len=s["seq"], float8=float8,
                              float8_min_features=s["float8_min_features"])
    optimizers = OptimizerGroup(built.parts, OptimConfig(lr=1e-4))
    scheduler = SchedulerGroup(optimizers.optimizers, ScheduleConfig(name="constant", warmup_steps=0),
                               s["warmup"] + s["steps"])
    engine = build_engine(built.parts, built.pipeline, optimizers, scheduler, dims, device=device,
                          precision="auto", grad_clip=1.0, document_mask=True)
    return engine, args


def train_variant(name: str, s: dict, device: torch.device, dims: ParallelDims) -> dict:
    """Time `s["steps"]` steps of variant `name` after `s["warmup"]` (the first compiles)."""
    engine, args = _engine(name, s, device, dims)
    torch.manual_seed(0)  # the same batch for every variant: their losses are comparable
    batch = synthetic_batch(args.vocab_size, s["micro"], s["seq"], device)
    times, first, out = [], 0.0, None
    for step in range(s["warmup"] + s["steps"]):
        _sync(device)
        start = time.perf_counter()
        out = engine.train_step([batch])
        _sync(device)
        elapsed = time.perf_counter() - start
        first = elapsed if step == 0 else first
        if step >= s["warmup"]:
            times.append(elapsed)
    tps = out.tokens / statistics.median(times)
    flops = build_from_args(args, device="meta").flops_per_token(s["seq"]) * tps
    peak = peak_flops(device, torch.bfloat16)
    mem = memory_stats(device).get("mem_peak_gb", float("nan"))  # CPU: the process's peak RSS so far
    mfu = f"MFU {100 * flops / peak:.1f}%" if peak else "MFU n/a (unknown peak)"
    figure = (f"{tps:,.0f} tokens/s, {flops / 1e12:.3g} TFLOP/s, {mfu}, peak {mem:.1f} GB, "
              f"loss {out.loss:.3f}, first step {first:.1f} s")
    return row("train", name, figure, note="non-finite: step skipped" if out.skipped else "", tokens_per_s=tps,
               tflops=flops / 1e12, mfu=flops / peak if peak else None, peak_gb=mem, loss=out.loss, first_step_s=first)


def train_section(s: dict, device: torch.device, variants: list[str], emit, deadline: float) -> list[dict]:
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1)
    dims.build_mesh(device.type)
    rows, baseline = [], None
    for name in variants:
        why = _unavailable(name, device) or (_late() if time.monotonic() > deadline else None)
        if why:
            r = row("train", name, note=f"skipped: {why}")
        else:
            try:
                r = train_variant(name, s, device, dims)
            except Exception as e:  # one variant failing (OOM, a compile error) is a row, not the end
                r = row("train", name, note=_failure(e))
            _free(device)
        tps = r["data"].get("tokens_per_s")
        baseline = tps if name == "eager" else baseline
        if tps and baseline:
            r["vs"] = f"{tps / baseline:.2f}x eager tokens/s"
        rows.append(emit(r))
    return rows


# -- 2. fused kernels ----------------------------------------------------------------------
def kernel_section(s: dict, device: torch.device, emit, deadline: float) -> list[dict]:
    from kernel_speed import SIZES as KERNEL_SIZES
    from kernel_speed import run

    if time.monotonic() > deadline:
        return [emit(row("kernels", "rms_norm, rope, swiglu", note=f"skipped: {_late()}"))]
    rows = []
    for k in run(device, dict(KERNEL_SIZES[s["kernels"]], repeats=s["kernel_repeats"])):
        ms, vs, note = k["ms fwd+bwd"], k["vs eager"], k["note"]
        if ms is None and note and not note.startswith("failed"):
            note = f"skipped: {note}"
        rows.append(emit(row("kernels", f"{k['op']}: {k['variant']}", "" if ms is None else f"{ms:.3f} ms fwd+bwd",
                             "" if vs is None else f"{vs:.2f}x eager", note, ms=ms, vs_eager=vs)))
    return rows


# -- 3. attention --------------------------------------------------------------------------
def attention_section(s: dict, device: torch.device, emit, deadline: float) -> list[dict]:
    """Forward + backward of one attention call: masks of 4 documents against plain causal."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, H, T, hd = s["micro"], 32 if device.type == "cuda" else 4, s["seq"], 64
    q, k, v = (torch.randn(B, H, T, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    doc_ids = (torch.arange(T, device=device) * 4 // T).expand(B, T)
    cases = {"SDPA causal": lambda: build_mask(None, q_len=T, kv_len=T, device=device),
             "FlexAttention, 4 documents": lambda: build_mask(doc_ids, q_len=T, kv_len=T, backend="flex"),
             "SDPA dense mask, 4 documents": lambda: build_mask(doc_ids, q_len=T, kv_len=T)}
    rows, baseline = [], None
    for name, mask in cases.items():
        r = row("attention", f"{name} (B={B}, H={H}, T={T}, hd={hd})")
        if device.type != "cuda" and "Flex" in name:
            r["note"] = "skipped: FlexAttention runs compiled on CUDA only here"
        elif time.monotonic() > deadline:
            r["note"] = f"skipped: {_late()}"
        else:
            try:
                ms = _attention_ms(q, k, v, mask(), s, device)
                baseline = ms if baseline is None and name == "SDPA causal" else baseline
                r.update(figure=f"{ms:.3f} ms fwd+bwd", vs=f"{baseline / ms:.2f}x SDPA causal" if baseline else "")
                r["data"]["ms"] = ms
            except Exception as e:
                r["note"] = _failure(e)
        rows.append(emit(r))
    return rows


def _attention_ms(q, k, v, mask, s: dict, device: torch.device) -> float:
    times = []
    for i in range(s["warmup"] + s["steps"]):
        _sync(device)
        start = time.perf_counter()
        attend(q, k, v, mask).sum().backward()
        _sync(device)
        if i >= s["warmup"]:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# -- the run -------------------------------------------------------------------------------
def markdown_table(rows: list[dict]) -> str:
    def cell(r: dict, key: str) -> str:
        text = r[key] or ("—" if key in ("figure", "vs") else "")
        return text.replace("|", "\\|")  # a pipe inside a cell (an error message's) would split it

    lines = ["| section | what | figure | vs baseline | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(r, k) for k in ("section", "what", "figure", "vs", "note")) + " |" for r in rows]
    return "\n".join(lines)


def run(size: str, *, sections: tuple[str, ...] = SECTIONS, variants: list[str] | None = None,
        budget_s: float | None = None, jsonl: Path | None = None) -> list[dict]:
    """Every section at `size` (tiny on the CPU, the others on CUDA); returns the rows and
    appends each to `jsonl` as soon as it is measured. Joins, or makes, the process group."""
    device = init_distributed("cpu" if size == "tiny" else "cuda").device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run: not speed figures)"
    print(f"# forja GPU benchmark, --size {size}, on {where}; torch {torch.__version__}", flush=True)
    deadline = time.monotonic() + (budget_s if budget_s is not None else float("inf"))

    def emit(r: dict) -> dict:
        if device.type != "cuda" and not r["note"]:  # not a speed: say so on every row
            r["note"] = "CPU smoke run, not a speed"
        print(f"[gpu.py] {r['section']} | {r['what']} | {r['figure']} | {r['vs']} | {r['note']}", flush=True)
        if jsonl is not None:
            with open(jsonl, "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
        return r

    s, rows = SIZES[size], []
    if "train" in sections:
        rows += train_section(s, device, variants or list(VARIANTS), emit, deadline)
    if "kernels" in sections:
        rows += kernel_section(s, device, emit, deadline)
    if "attention" in sections:
        rows += attention_section(s, device, emit, deadline)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="full", help="tiny runs on the CPU; check and full "
                        "need a CUDA GPU")
    parser.add_argument("--tiny", action="store_const", dest="size", const="tiny", help="same as --size tiny")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="training variants (eager, the baseline, is in the default)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip what would start after this many seconds")
    parser.add_argument("--jsonl", type=Path, default=None, help="append each row here as JSON when measured")
    args = parser.parse_args()
    if args.size != "tiny" and not torch.cuda.is_available():
        sys.exit(f"bench/gpu.py --size {args.size} needs a CUDA GPU and PyTorch sees none; "
                 "run --size tiny to check the script on a CPU")
    # A warm cache makes a rerun's compilation quick (the "first step" figure says how long it took).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("runs/.inductor-cache").resolve()))
    try:
        rows = run(args.size, sections=tuple(args.sections), variants=args.variants, budget_s=args.budget_s,
                   jsonl=args.jsonl)
    finally:
        shutdown_distributed()
    print("\n" + markdown_table(rows))


if __name__ == "__main__":
    main()
