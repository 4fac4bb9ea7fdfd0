"""The speed issue's GPU benchmark, one script (about 8 minutes on one H200).

    python bench/gpu.py                 # on a GPU: Llama 3.2 1B at 4096 tokens/sequence
    python bench/gpu.py --tiny          # anywhere (CPU): tiny sizes, to show the script works

Prints three tables, each measured side by side in this run:
1. training steps of `llama 3.2-1b` (bf16, FSDP degree 1, synthetic tokens): tokens/s, MFU
   and peak memory for eager / compile / compile + fused ops / + float8, with the speed-up
   of each against eager;
2. each fused kernel (forward + backward) against PyTorch eager, torch.compile and Liger
   Kernel (bench/kernels.py);
3. attention: FlexAttention with a document mask against SDPA causal (flash) at the same
   sequence length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forja.metrics.throughput import memory_stats, peak_flops  # noqa: E402
from forja.models import build_from_args, model_args  # noqa: E402
from forja.optim import OptimizerGroup  # noqa: E402
from forja.optim.config import OptimConfig  # noqa: E402
from forja.parallel import build_parallel_model  # noqa: E402
from forja.parallel.config import ParallelConfig  # noqa: E402
from forja.parallel.dims import ParallelDims  # noqa: E402
from forja.parallel.process_group import init_distributed  # noqa: E402
from forja.train.step import train_step  # noqa: E402

VARIANTS = {  # name -> (parallel.compile, model.fused_ops, train.float8)
    "eager": (False, False, "none"),
    "compile": (True, False, "none"),
    "compile + fused ops": (True, True, "none"),
    "compile + fused ops + float8": (True, True, "tensorwise"),
}


class Batch:
    def __init__(self, tokens: torch.Tensor, doc_ids: torch.Tensor):
        self.input_ids, self.labels, self.document_ids = tokens[:, :-1], tokens[:, 1:], doc_ids


def synthetic_batch(vocab: int, micro: int, seq: int, device: torch.device, docs: int = 4) -> Batch:
    tokens = torch.randint(0, vocab, (micro, seq + 1), device=device)
    doc_ids = (torch.arange(seq, device=device) * docs // seq).expand(micro, seq)  # `docs` equal documents
    return Batch(tokens, doc_ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_variant(name: str, sizes: dict, device: torch.device, dims, mesh) -> dict:
    compile_, fused, float8 = VARIANTS[name]
    fused_ops = ("rms_norm", "rope", "swiglu", "cross_entropy") if fused else ()
    args = model_args("llama", sizes["flavor"], fused_ops=fused_ops, attention=sizes["attention"],
                      **sizes["overrides"])
    cfg = ParallelConfig(compile=compile_, mixed_precision="bf16" if device.type == "cuda" else "fp32")
    built = build_parallel_model(args, "llama", dims=dims, mesh=mesh, cfg=cfg, device=device, seed=0,
                                 float8=float8, float8_min_features=sizes["float8_min_features"])
    optimizers = OptimizerGroup(built.parts, OptimConfig(lr=1e-4))
    torch.manual_seed(0)  # the same batch for every variant: their losses are comparable
    batch = synthetic_batch(args.vocab_size, sizes["micro"], sizes["seq"], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], float("nan")
    for step in range(sizes["warmup"] + sizes["steps"]):
        _sync(device)
        start = time.perf_counter()
        out = train_step(built.parts, optimizers, [batch], device=device, compute_dtype=None, grad_clip=1.0,
                         document_mask=True, dp_group=None, dp_size=1)
        optimizers.step()
        _sync(device)
        if step >= sizes["warmup"]:
            times.append(time.perf_counter() - start)
        loss = out.loss
    tokens = sizes["micro"] * sizes["seq"]
    tps = tokens / statistics.median(times)
    flops = build_from_args(args, device="meta").flops_per_token(sizes["seq"]) * tps
    peak = peak_flops(device, torch.bfloat16)
    mem = memory_stats(device).get("mem_peak_gb", float("nan"))  # CPU: the process's peak RSS
    del built, optimizers
    return {"variant": name, "tokens/s": tps, "TFLOP/s": flops / 1e12, "MFU": flops / peak if peak else None,
            "peak GB": mem, "loss": loss}


def attention_bench(sizes: dict, device: torch.device) -> list[dict]:
    """Forward + backward of one attention call: SDPA causal vs FlexAttention documents."""
    from forja.models.common.attention import attend, build_mask

    B, H, T, hd = sizes["micro"], 32 if device.type == "cuda" else 4, sizes["seq"], 64
    q, k, v = (torch.randn(B, H, T, hd, device=device, dtype=sizes["dtype"], requires_grad=True) for _ in range(3))
    doc_ids = (torch.arange(T, device=device) * 4 // T).expand(B, T)
    cases = {"SDPA causal": build_mask(None, q_len=T, kv_len=T, device=device)}
    if device.type == "cuda":
        cases["FlexAttention, 4 documents"] = build_mask(doc_ids, q_len=T, kv_len=T, backend="flex")
    cases["SDPA dense mask, 4 documents"] = build_mask(doc_ids, q_len=T, kv_len=T)
    rows = []
    for name, mask in cases.items():
        times = []
        for i in range(sizes["warmup"] + sizes["steps"]):
            _sync(device)
            start = time.perf_counter()
            attend(q, k, v, mask).sum().backward()
            _sync(device)
            if i >= sizes["warmup"]:
                times.append(time.perf_counter() - start)
        rows.append({"attention": name, "ms fwd+bwd": 1e3 * statistics.median(times)})
    return rows


def print_table(title: str, rows: list[dict], baseline_key: str | None = None) -> None:
    print(f"\n## {title}\n")
    if not rows:
        print("(no rows)")
        return
    keys = list(rows[0])
    print("| " + " | ".join(keys) + (" | vs first |" if baseline_key else " |"))
    print("|" + "---|" * (len(keys) + (1 if baseline_key else 0)))
    for row in rows:
        cells = [f"{v:,.3f}" if isinstance(v, float) else ("n/a" if v is None else str(v)) for v in row.values()]
        if baseline_key:
            cells.append(f"{row[baseline_key] / rows[0][baseline_key]:.2f}x")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        sizes = dict(flavor="debug", overrides={"tie_embeddings": False}, seq=128, micro=2, warmup=2, steps=3,
                     attention="sdpa", float8_min_features=0, dtype=torch.float32)
    else:
        sizes = dict(flavor="3.2-1b", overrides={}, seq=4096, micro=2, warmup=3, steps=10, attention="flex",
                     float8_min_features=1024, dtype=torch.bfloat16)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("runs/.inductor-cache").resolve()))
    info = init_distributed("cuda" if device.type == "cuda" else "cpu")
    dims = ParallelDims.from_config(ParallelConfig(), info.world_size)
    mesh = dims.build_mesh(device.type)
    print(f"# forja GPU benchmark on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}, {'tiny smoke run' if args.tiny else 'llama 3.2-1b'}")
    rows = [train_variant(name, sizes, device, dims, mesh) for name in args.variants]
    print_table("Training steps (median step time)", rows, baseline_key="tokens/s")
    try:
        from bench.kernels import run as kernel_run
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kernels import run as kernel_run  # type: ignore[no-redef]
    print_table("Kernels (forward + backward)", kernel_run(device, "tiny" if args.tiny else "llama-1b"))
    print_table("Attention", attention_bench(sizes, device))


if __name__ == "__main__":
    main()
