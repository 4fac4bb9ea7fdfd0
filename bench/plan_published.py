"""`forja plan` against published training runs: torchtitan's Llama 3.1 8B/70B/405B on H100s
and Megatron-Core's GPT weak-scaling table (sources and every setting in docs/planner.md).

    python bench/plan_published.py            # the comparison table (markdown)

Each run is planned for its own layout (`evaluate`), with forja's nearest settings: bf16
parameters gathered by FSDP (torchtitan and Megatron both compute in bf16), forja's fused
kernels (its answer to the logits' memory), compile where the run compiled. Megatron's
distributed optimizer shards optimizer state over its DP ranks; forja's nearest is FSDP over
them (dp_shard = DP). The planner's own first choice for the same job is reported too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.config import load_config  # noqa: E402
from forja.plan.hardware import get_hardware  # noqa: E402
from forja.plan.job import job_from_config  # noqa: E402
from forja.plan.layout import SearchSpace, from_config  # noqa: E402
from forja.plan.planner import Candidate, evaluate, plan  # noqa: E402

DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
MEGATRON = "Megatron-LM README (Megatron-Core r0.8.0, images/model_table.png)"
# torchtitan's H100s are Grand Teton's 96 GB HBM2e parts, power-capped at 500 W.
TITAN_GPU = dict(kind="h100", memory_gb=96)


@dataclass
class Run:
    name: str
    source: str
    gpus: int
    published: float
    """tokens/s per GPU as published (Megatron: derived from its TFLOP/s, see docs/planner.md)."""
    sets: list[str]
    gpu: dict = field(default_factory=lambda: dict(kind="h100", memory_gb=None))
    free: bool = False
    """Only the degrees were published: the planner picks micro-batch, AC, ZeRO stage and schedule."""


def _llama(flavor: str, seq: int, batch: int, mbs: int, *layout: str, compile_: bool = True,
           float8: bool = False) -> list[str]:
    return [f"model.flavor={flavor}", "model.family=llama", "model.fused_ops=true", f"train.seq_len={seq}",
            f"train.global_batch_size={batch}", f"train.micro_batch_size={mbs}", "data.vocab_size=128256",
            "parallel.mixed_precision=bf16", f"parallel.compile={str(compile_).lower()}",
            f"train.float8={'tensorwise' if float8 else 'none'}", *layout]


def _gpt(dim: int, layers: int, heads: int, tp: int, pp: int, dp: int, batch: int) -> list[str]:
    return ["model.family=gpt2", "model.flavor=124m", f"model.overrides.dim={dim}", f"model.overrides.n_layers={layers}",
            f"model.overrides.n_heads={heads}", f"model.overrides.ffn_dim={4 * dim}", "model.overrides.max_seq_len=4096",
            "data.vocab_size=131072", "train.seq_len=4096", f"train.global_batch_size={batch}",
            "train.micro_batch_size=1", "model.fused_ops=true", "parallel.mixed_precision=bf16",
            "parallel.compile=true", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp_shard={dp}"]


RUNS = [
    Run("Llama 3.1 8B, FSDP 8, SAC, eager", TORCHTITAN, 8, 5762,
        _llama("3.1-8b", 8192, 16, 2, "parallel.dp_shard=8", "parallel.ac=selective", compile_=False), TITAN_GPU),
    Run("Llama 3.1 8B, FSDP 8, SAC, compile", TORCHTITAN, 8, 6667,
        _llama("3.1-8b", 8192, 16, 2, "parallel.dp_shard=8", "parallel.ac=selective"), TITAN_GPU),
    Run("Llama 3.1 8B, FSDP 8, SAC, compile, float8", TORCHTITAN, 8, 8532,
        _llama("3.1-8b", 8192, 16, 2, "parallel.dp_shard=8", "parallel.ac=selective", float8=True), TITAN_GPU),
    Run("Llama 3.1 8B, FSDP 128, SAC, compile", TORCHTITAN, 128, 6514,
        _llama("3.1-8b", 8192, 256, 2, "parallel.dp_shard=128", "parallel.ac=selective"), TITAN_GPU),
    Run("Llama 3.1 70B, FSDP 32 x TP 8, full AC, compile", ASYNC_TP, 256, 597.3,
        _llama("3.1-70b", 8192, 512, 16, "parallel.dp_shard=32", "parallel.tp=8", "parallel.ac=full"), TITAN_GPU),
    Run("Llama 3.1 70B, FSDP 32 x TP 8, full AC, compile, float8", TORCHTITAN, 256, 829,
        _llama("3.1-70b", 8192, 512, 16, "parallel.dp_shard=32", "parallel.tp=8", "parallel.ac=full",
               float8=True), TITAN_GPU),
    Run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B, float8", TORCHTITAN, 512, 100,
        _llama("3.1-405b", 8192, 256, 1, "parallel.dp_shard=8", "parallel.tp=8", "parallel.pp=8",
               "parallel.ac=full", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=8", float8=True),
        TITAN_GPU),
    Run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, interleaved 1F1B, float8", TORCHTITAN, 512, 128,
        _llama("3.1-405b", 8192, 256, 1, "parallel.dp_shard=8", "parallel.tp=8", "parallel.pp=8",
               "parallel.ac=full", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_microbatches=8",
               float8=True), TITAN_GPU),
    Run("GPT 1.7B, TP 1 x DP 48", MEGATRON, 48, 36259, _gpt(2048, 24, 16, 1, 1, 48, 192), free=True),
    Run("GPT 7.1B, TP 2 x DP 48", MEGATRON, 96, 10240, _gpt(4096, 30, 32, 2, 1, 48, 192), free=True),
    Run("GPT 16B, TP 4 x DP 48", MEGATRON, 192, 4820, _gpt(6144, 32, 48, 4, 1, 48, 192), free=True),
    Run("GPT 32B, TP 8 x DP 48", MEGATRON, 384, 2297, _gpt(7168, 48, 56, 8, 1, 48, 192), free=True),
    Run("GPT 70B, TP 8 x PP 2 x DP 48", MEGATRON, 768, 941, _gpt(8192, 84, 64, 8, 2, 48, 384), free=True),
    Run("GPT 119B, TP 8 x PP 4 x DP 48", MEGATRON, 1536, 561, _gpt(10240, 92, 80, 8, 4, 48, 768), free=True),
    Run("GPT 177B, TP 8 x PP 6 x DP 48", MEGATRON, 2304, 389, _gpt(12288, 96, 96, 8, 6, 48, 1152), free=True),
    Run("GPT 314B, TP 8 x PP 8 x DP 48", MEGATRON, 3072, 244, _gpt(16384, 96, 128, 8, 8, 48, 1536), free=True),
    Run("GPT 462B, TP 8 x PP 16 x DP 48", MEGATRON, 6144, 161, _gpt(18432, 112, 144, 8, 16, 48, 3072), free=True),
]


def predict(run: Run, *, search: bool = False) -> tuple[Candidate, Candidate | None]:
    """The prediction for the run's own layout, and (with `search`) the planner's first choice."""
    cfg = load_config("configs/llama3-8b.toml", run.sets)
    hw = get_hardware(run.gpu["kind"], memory_gb=run.gpu["memory_gb"])
    job = job_from_config(cfg, gpu=True)
    own = evaluate(job, from_config(cfg.parallel, cfg.train.micro_batch_size, run.gpus), hw)
    if run.free:  # the best memory options for the published degrees
        space = SearchSpace(gpus_per_node=hw.gpus_per_node,
                            degrees=tuple((k, getattr(own.layout, k)) for k in DEGREES))
        own = plan(job, hw, run.gpus, space=space)[0]
    return own, (plan(job, hw, run.gpus)[0] if search else None)


def main() -> None:
    print("| run | GPUs | published tok/s/GPU | predicted | predicted / published | fits (peak GB) | "
          "planner's first choice (tok/s/GPU) | source |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    for run in RUNS:
        own, best = predict(run, search="--search" in sys.argv)
        ratio = own.tokens_per_sec_per_device / run.published
        first = (f"{best.layout.describe().replace(' | ', ', ')}: {best.tokens_per_sec_per_device:,.0f}"
                 f" ({best.tokens_per_sec_per_device / own.tokens_per_sec_per_device:.2f}x)" if best else "-")
        print(f"| {run.name} | {run.gpus} | {run.published:,.0f} | {own.tokens_per_sec_per_device:,.0f} | "
              f"{ratio:.2f} | {'yes' if own.fits else 'NO: ' + own.why_not} ({own.memory.total / 1e9:.1f}) | "
              f"{first} | {run.source} |")


if __name__ == "__main__":
    main()
