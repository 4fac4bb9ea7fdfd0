"""`forja plan`'s speed model against published training runs: a validation table.

    python bench/plan_published.py              # the table and the error distribution (markdown)

Each row is one published run in its published configuration (model, GPUs, global batch,
sequence length, precision, parallel degrees, activation checkpointing), evaluated by
`forja.plan.planner.evaluate` for exactly that layout. The speed model's constants come from
datasheets and microbenchmarks (forja/plan/speed.py, docs/planner.md "Calibration"), never from
these rows, so the table measures a prediction, not a fit.

What a source does not state is filled with a stated default, never chosen per row to make it
agree (Megatron-LM's table: micro-batch 1; no recomputation and 1F1B, Megatron's defaults);
such rows say so in their `assumed` column. A setting forja cannot express (a virtual-pipeline size other than 2, a
model
family forja lacks) makes the row `inexpressible`: listed with the reason, left out of the
statistics. The sources, each at the commit read, are in SOURCES; docs/planner.md lists them.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.config import load_config  # noqa: E402
from forja.plan.hardware import Hardware, get_hardware  # noqa: E402
from forja.plan.job import job_from_config  # noqa: E402
from forja.plan.layout import Layout  # noqa: E402
from forja.plan.planner import Candidate, evaluate, usable_memory  # noqa: E402

SOURCES = {
    "torchtitan": "pytorch/torchtitan@b5bcd76c66d0acb1a08b176d9639425bc55e0b2a "
                  "benchmarks/llama3_h100_202412_torchtitan.md",
    "torchtitan-asynctp": "pytorch/torchtitan@b5bcd76c66d0acb1a08b176d9639425bc55e0b2a "
                          "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
    "megatron-lm": "NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553 README.md, images/model_table.png",
    "megatron-bridge": "NVIDIA-NeMo/Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a "
                       "docs/fern/versions/nightly/pages/performance-summary.mdx (26.04.01 container)",
    "megatron-bridge-25.11": "NVIDIA-NeMo/Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a "
                             "docs/fern/versions/nightly/pages/performance-summary-archive.mdx (25.11 container)",
    "olmo-core": "allenai/OLMo-core@7e58d1289bc27103880e7a8382ad0847c35e04f7 README.md, src/scripts/train/Llama3-8B.py",
    "maxtext": "AI-Hypercomputer/maxtext@e591f30cbbf217ed67ef71263ec0538239f9c3b8 "
               "src/maxtext/configs/gpu/a3/llama_2_7b/README.md, 1vm.sh..16vm.sh, configs/gpu/models/llama2_7b.yml",
}
# The repository a source key belongs to: the statistics are per source repository.
REPOSITORY = {"torchtitan": "torchtitan", "torchtitan-asynctp": "torchtitan", "megatron-lm": "Megatron-LM",
              "megatron-bridge": "Megatron-Bridge", "megatron-bridge-25.11": "Megatron-Bridge",
              "olmo-core": "OLMo-core", "maxtext": "MaxText"}

LLAMA = {"model.family": "llama", "data.vocab_size": 128256}
# torchtitan's H100s, as its benchmark file describes them (Meta Grand Teton): 96 GB HBM2e at
# 2.4 TB/s, run at a 500 W power limit, a peak "between SXM and NVL" (dense bf16: SXM 989.4,
# H100 NVL datasheet 835.5 TFLOP/s): forja takes the midpoint, 912, and fp8 twice that. Its
# memory as the device reports it is estimated as the 80 GB H100's is measured (99% of the
# vendor's figure read as GiB): 95.0 GiB. The file's reserved peaks reach 84.9 GiB.
TITAN_GPU = ("h100-500w", 95.0)
TITAN_HARDWARE = dict(name="NVIDIA H100 96GB HBM2e, 500 W (Grand Teton)", bf16_flops=912.5e12, fp8_flops=1825e12,
                      hbm_bytes_per_s=2.4e12, source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md")


@dataclass
class Run:
    name: str
    source: str
    gpus: int
    published: float
    """tokens/s per GPU as published, or converted from published TFLOP/s (see `converted`)."""
    model: dict
    seq: int
    batch: int
    layout: dict
    gpu: tuple = ("h100", None)
    float8: str = "none"
    compile_: bool = True
    bf16_params: bool = True
    assumed: str = ""
    """What the source does not state, and the default taken."""
    converted: str = ""
    inexpressible: str = ""
    """Why forja cannot express the published setting (the row is then out of the statistics)."""
    extra: dict = field(default_factory=dict)
    published_gib: float | None = None
    """Peak memory per GPU as published (torchtitan: the caching allocator's reserved peak, GiB)."""


def _titan_ac(ac: str) -> dict:
    """torchtitan's activation checkpointing as forja's keys: its op-level selective AC keeps
    every second `mm` of a block's (torchtitan/distributed/activation_checkpoint.py)."""
    return dict(ac=ac, ac_matmuls="alternate") if ac == "selective" else dict(ac=ac)


def _titan_8b(name, gpus, tps, seq, batch, mbs, layout, *, float8="none", compile_=True, ac="selective",
              source="torchtitan", assumed="", mem=None):
    return Run(name, source, gpus, tps, {**LLAMA, "model.flavor": "3.1-8b"}, seq, batch,
               dict(layout, **_titan_ac(ac), micro_batch_size=mbs), TITAN_GPU, float8, compile_, assumed=assumed,
               inexpressible=_ring(layout), published_gib=mem)


# torchtitan's context parallelism is PyTorch's ring over fused flash-attention kernels; forja's own
# ring runs its CUDA blocks as fp32 matmuls (no fused block kernel yet), a different program: its
# prediction says what forja would do, not how well the model predicts that run.
FUSED_RING = "forja's ring has no fused CUDA block kernel yet; the run used PyTorch's ring over flash attention"


def _ring(layout: dict) -> str:
    return FUSED_RING if layout.get("cp", 1) > 1 else ""


SEQ_FROM_CONFIG = "seq_len 8192 from torchtitan's train config (the table does not state it)"
RUNS: list[Run] = [
    # -- torchtitan, Llama 3.1 on 96 GB / 500 W H100 (tables 1-6 of the 2024-12 file) ------------
    _titan_8b("8B FSDP 8, SAC, eager", 8, 5762, 8192, 16, 2, dict(dp_shard=8), compile_=False, assumed=SEQ_FROM_CONFIG,
              mem=82.4),
    _titan_8b("8B FSDP 8, SAC, compile", 8, 6667, 8192, 16, 2, dict(dp_shard=8), assumed=SEQ_FROM_CONFIG, mem=77.0),
    _titan_8b("8B FSDP 8, SAC, compile, float8", 8, 8532, 8192, 16, 2, dict(dp_shard=8), float8="tensorwise",
              assumed=SEQ_FROM_CONFIG, mem=76.8),
    _titan_8b("8B FSDP 8 CP 1, 32k, full AC, float8", 8, 3890, 32768, 8, 1, dict(dp_shard=8), float8="tensorwise",
              ac="full", mem=83.9),
    _titan_8b("8B FSDP 4 CP 2, 64k, full AC, float8", 8, 2540, 65536, 4, 1, dict(dp_shard=4, cp=2),
              float8="tensorwise", ac="full", mem=84.2),
    _titan_8b("8B FSDP 2 CP 4, 128k, full AC, float8", 8, 1071, 131072, 2, 1, dict(dp_shard=2, cp=4),
              float8="tensorwise", ac="full", mem=84.0),
    _titan_8b("8B CP 8, 256k, full AC, float8", 8, 548, 262144, 1, 1, dict(cp=8), float8="tensorwise", ac="full",
              mem=84.5),
    _titan_8b("8B FSDP 128, SAC, eager", 128, 5605, 8192, 256, 2, dict(dp_shard=128), compile_=False,
              assumed=SEQ_FROM_CONFIG, mem=67.0),
    _titan_8b("8B FSDP 128, SAC, compile", 128, 6514, 8192, 256, 2, dict(dp_shard=128), assumed=SEQ_FROM_CONFIG,
              mem=62.0),
    _titan_8b("8B FSDP 128, SAC, compile, float8", 128, 8380, 8192, 256, 2, dict(dp_shard=128), float8="tensorwise",
              assumed=SEQ_FROM_CONFIG, mem=61.8),
]


def _titan_big(name, flavor, gpus, tps, batch, mbs, layout, *, seq=8192, float8="tensorwise", async_tp=False,
               source="torchtitan", ac="full", assumed=SEQ_FROM_CONFIG, mem=None):
    return Run(name, source, gpus, tps, {**LLAMA, "model.flavor": flavor}, seq, batch,
               dict(layout, **_titan_ac(ac), micro_batch_size=mbs), TITAN_GPU, float8, assumed=assumed,
               extra={"parallel.async_tp": async_tp}, inexpressible=_ring(layout), published_gib=mem)


PP_MICRO = "pipeline micro-batches not stated: 8 (torchtitan's default, the pipeline degree)"
_405 = dict(dp_shard=8, tp=8, pp=8, pp_microbatches=8)
RUNS += [
    _titan_big("70B FSDP 32 x TP 8, full AC, float8", "3.1-70b", 256, 829, 512, 16, dict(dp_shard=32, tp=8), mem=71.9),
    _titan_big("70B FSDP 32 x TP 8, full AC, float8, async TP", "3.1-70b", 256, 876, 512, 16,
               dict(dp_shard=32, tp=8), async_tp=True, mem=67.6),
    _titan_big("405B FSDP 8 x TP 8 x PP 8, 1F1B, float8, async TP", "3.1-405b", 512, 100, 256, 1,
               dict(_405, pp_schedule="1f1b"), async_tp=True, assumed=f"{SEQ_FROM_CONFIG}; {PP_MICRO}", mem=82.5),
    _titan_big("405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B, float8, async TP", "3.1-405b", 512, 128, 256, 1,
               dict(_405, pp_schedule="interleaved-1f1b"), async_tp=True, assumed=f"{SEQ_FROM_CONFIG}; {PP_MICRO}",
               mem=72.7),
]
for fsdp, cp, tps, mem in ((8, 1, 76, 75.3), (4, 2, 47, 75.9), (2, 4, 31, 77.1), (1, 8, 16, 84.9)):
    RUNS.append(_titan_big(f"405B FSDP {fsdp} CP {cp} TP 8 PP 8, {32 * cp}k, 1F1B, float8, async TP", "3.1-405b",
                           512, tps, 8 * fsdp, 1, dict(dp_shard=fsdp, cp=cp, tp=8, pp=8, pp_microbatches=8,
                                                       pp_schedule="1f1b"),
                           seq=32768 * cp, async_tp=True, assumed=PP_MICRO, mem=mem))
# -- torchtitan async TP (2025-06): tokens/s per GPU, TP and async TP columns ------------------
ASYNC_SEQ = "sequence length not stated: 8192 (torchtitan's train config)"
for precision, tp_tps, async_tps in (("none", 597.3, 652.4), ("tensorwise", 809.8, 942.4),
                                     ("rowwise", 599.6, 624.8)):
    for on, tps in ((False, tp_tps), (True, async_tps)):
        RUNS.append(_titan_big(f"70B FSDP 32 x TP 8, full AC, {precision if precision != 'none' else 'bf16'}"
                               f"{', async TP' if on else ''}", "3.1-70b", 256, tps, 512, 16,
                               dict(dp_shard=32, tp=8), float8=precision, async_tp=on, source="torchtitan-asynctp",
                               assumed=ASYNC_SEQ))
for precision, tp_tps, async_tps in (("none", 4378, 4809.4), ("tensorwise", 5078.1, 5570.1),
                                     ("rowwise", 3708.5, 3914.9)):
    for on, tps in ((False, tp_tps), (True, async_tps)):
        RUNS.append(_titan_big(f"8B FSDP 8 x TP 8, SAC, {precision if precision != 'none' else 'bf16'}"
                               f"{', async TP' if on else ''}", "3.1-8b", 64, tps, 96, 12, dict(dp_shard=8, tp=8),
                               float8=precision, async_tp=on, source="torchtitan-asynctp", ac="selective",
                               assumed=ASYNC_SEQ))


# -- Megatron-LM (Megatron-Core r0.8.0): GPT weak scaling on H100, TFLOP/s per GPU --------------
def megatron_gpt_flops(h: int, layers: int, seq: int = 4096, vocab: int = 131072) -> float:
    """Megatron's FLOPs per token (megatron/training/training.py num_floating_point_operations at
    core_r0.8.0, its defaults: FFN 4h, full multi-head attention): 12 L h^2 (6 + s/h) + 6 h V."""
    return 12 * layers * h * h * (6 + seq / h) + 6 * h * vocab


MEGATRON_ASSUMED = ("micro-batch, recomputation and schedule not published: mbs 1; no AC and 1F1B (Megatron's "
                    "defaults); Megatron's distributed optimizer over DP 48 as forja's: FSDP 48, ZeRO-2, "
                    "gradients reduced once a step (parallel.grad_sync = 'step'; under PP the schedule does so)")
# Megatron's distributed optimizer (the DP ranks shard the optimizer state and the fp32 weights;
# gradients reduced, weights gathered once a step) as forja expresses it.
DIST_OPT_LAYOUT = dict(reshard_after_forward=False, grad_sync="step")
for size, heads, h, layers, tp, pp, gpus, batch, tflops in (
        ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9)):
    RUNS.append(Run(f"GPT {size}, TP {tp} x PP {pp} x DP 48", "megatron-lm", gpus,
                    tflops * 1e12 / megatron_gpt_flops(h, layers),
                    {"model.family": "gpt2", "model.flavor": "124m", "model.overrides.dim": h,
                     "model.overrides.n_layers": layers, "model.overrides.n_heads": heads,
                     "model.overrides.ffn_dim": 4 * h, "model.overrides.max_seq_len": 4096,
                     "data.vocab_size": 131072}, 4096, batch,
                    # under PP the schedule itself reduces once a step
                    dict(dp_shard=48, tp=tp, pp=pp, **DIST_OPT_LAYOUT if pp == 1 else {"reshard_after_forward": False}),
                    assumed=MEGATRON_ASSUMED, converted=f"{tflops} TFLOP/s/GPU / Megatron's FLOPs per token"))


# -- Megatron-Bridge performance summary (tokens/s per GPU as published) -----------------------
def _bridge(name, model, gpus, tps, seq, batch, mbs, layout, gpu, *, float8="tensorwise", source="megatron-bridge",
            assumed="", inexpressible="", recompute=""):
    """A row of Megatron-Bridge's performance summary; `recompute`: what its performance preset
    recomputes (scripts/performance/configs at v0.4.2), as forja's op-level selective AC, the
    closest forja has; none where the preset sets none."""
    note = (f"the preset recomputes {recompute}: as forja's op-level selective AC" if recompute
            else "the preset recomputes nothing") + "; TE's fused kernels as forja's compile"
    dp_note = "; DDP + distributed optimizer as FSDP (forja's EP lives in dp_shard)" if layout.get("ep") else ""
    mx = "; MXFP8 as forja's float8 (no MX recipe)" if "MXFP8" in name else ""
    ac = {"ac": "selective"} if recompute else {}
    return Run(name, source, gpus, tps, model, seq, batch, dict(layout, micro_batch_size=mbs, **ac), (gpu, None),
               float8, assumed="; ".join(filter(None, (note + dp_note + mx, assumed))), inexpressible=inexpressible)


QWEN30 = {"model.family": "qwen3", "model.flavor": "30b-a3b", "data.vocab_size": 151936}
QWEN235 = {"model.family": "qwen3", "model.flavor": "235b-a22b", "data.vocab_size": 151936}
DSV3 = {"model.family": "deepseek_v3", "model.flavor": "671b", "data.vocab_size": 129280}
GPT_OSS = {"model.family": "gpt_oss", "model.flavor": "120b", "data.vocab_size": 201088}
L70 = {**LLAMA, "model.flavor": "3.1-70b"}
L405 = {**LLAMA, "model.flavor": "3.1-405b"}
L8 = {**LLAMA, "model.flavor": "3.1-8b"}
DIST_OPT = "DDP + distributed optimizer as forja's: FSDP, ZeRO-2, gradients reduced once a step (grad_sync 'step')"
VP = "forja's interleaved schedule runs 2 stages per rank; the run used VP {}"
RUNS += [
    _bridge("Llama 3 70B, GB200, FP8, FSDP 64", L70, 64, 4224, 8192, 256, 2, dict(dp_shard=64), "gb200",
            inexpressible="the preset offloads 40 of the 80 layers' activations to host memory "
                          "(cpu_offloading_num_layers = 40): forja has no activation offloading"),
    _bridge("Llama 3 70B, H100, FP8, TP 4 x PP 8 VP 5", L70, 64, 1664, 8192, 256, 1,
            dict(dp_replicate=2, tp=4, pp=8, pp_schedule="interleaved-1f1b"), "h100", inexpressible=VP.format(5)),
    _bridge("Llama 3.1 405B, H100, FP8, TP 8 x PP 8 x CP 2 VP 8", L405, 1024, 328, 8192, 1536, 1,
            dict(dp_replicate=8, tp=8, pp=8, cp=2, pp_schedule="interleaved-1f1b"), "h100",
            inexpressible=VP.format(8)),
    _bridge("DeepSeek-V3, B200, MXFP8, PP 8 VP 2 x EP 32", DSV3, 256, 3328, 4096, 4096, 1,
            dict(dp_shard=32, ep=32, pp=8, pp_schedule="interleaved-1f1b"), "b200", recompute="mla_up_proj and mlp",
            assumed="Adam's moments and the main gradients in bf16 there (precision-aware optimizer), fp32 in forja"),
    _bridge("DeepSeek-V3, GB200, MXFP8, PP 4 VP 4 x EP 64", DSV3, 256, 4256, 4096, 4096, 1,
            dict(dp_shard=64, ep=64, pp=4, pp_schedule="interleaved-1f1b"), "gb200", inexpressible=VP.format(4)),
    _bridge("Qwen3-30B-A3B, B200, MXFP8, EP 8", QWEN30, 8, 27136, 4096, 512, 4, dict(dp_shard=8, ep=8), "b200"),
    _bridge("Qwen3-30B-A3B, GB200, MXFP8, EP 8", QWEN30, 8, 26112, 4096, 512, 4, dict(dp_shard=8, ep=8), "gb200"),
    _bridge("Qwen3-30B-A3B, H100, FP8, EP 16", QWEN30, 16, 8960, 4096, 1024, 1, dict(dp_shard=16, ep=16), "h100"),
    _bridge("Qwen3-235B-A22B, B200, MXFP8, PP 8 x EP 8", QWEN235, 256, 3776, 4096, 8192, 1,
            dict(dp_shard=32, ep=8, pp=8), "b200"),
    _bridge("Qwen3-235B-A22B, H100, FP8, TP 2 x PP 8 VP 4 x EP 32", QWEN235, 256, 1712, 4096, 8192, 1,
            dict(dp_shard=16, tp=2, pp=8, ep=32, pp_schedule="interleaved-1f1b"), "h100", inexpressible=VP.format(4)),
    _bridge("GPT-OSS 120B, H100, BF16, PP 4 x EP 8", GPT_OSS, 64, 5824, 4096, 1280, 1, dict(dp_shard=16, pp=4, ep=8),
            "h100", float8="none", recompute="layernorm and moe_act"),
    _bridge("Llama 3 8B, H100, FP8-CS, FSDP 8", L8, 8, 14451, 8192, 128, 1, dict(dp_shard=8), "h100",
            source="megatron-bridge-25.11"),
    _bridge("Llama 3 8B, B200, FP8-CS, DP 8", L8, 8, 30624, 8192, 128, 2, dict(dp_shard=8, **DIST_OPT_LAYOUT), "b200",
            source="megatron-bridge-25.11", assumed=DIST_OPT),
    _bridge("Llama 3 8B, GB200, FP8-CS, DP 8", L8, 8, 31508, 8192, 128, 2, dict(dp_shard=8, **DIST_OPT_LAYOUT), "gb200",
            source="megatron-bridge-25.11", assumed=DIST_OPT),
]

# -- OLMo-core README (before 41f8ddc, 2025-03): tokens/s per H100 --------------------------------
OLMO_ASSUMED = ("GPU count not published: 64 (HSDP 8 x 8, a node per shard group); seq 4096, global batch "
                "1024 x 4096 tokens, 2 sequences per rank micro-batch, compile, bf16 params, no AC, from the script")
for precision, tps in (("none", 9500), ("tensorwise", 12500)):
    RUNS.append(Run(f"Llama 3 8B, HSDP, {'bf16' if precision == 'none' else 'bf16/float8'}", "olmo-core", 64, tps,
                    {**L8, "data.vocab_size": 100352}, 4096, 1024,
                    dict(dp_replicate=8, dp_shard=8, micro_batch_size=2), float8=precision, assumed=OLMO_ASSUMED))
# OLMo-2: the scripts' rank micro-batches (src/scripts/train/OLMo2-1B.py 8 x 4096 tokens, OLMo2-13B.py
# 1 x 4096; OLMo2-7B.py 2 sequences), read at later commits than the README's: the scripts of its
# own commit are not at hand.
OLMO2_MBS = {"1B": 8, "7B": 2, "13B": 1}
OLMO2_ASSUMED = OLMO_ASSUMED.replace("2 sequences per rank micro-batch", "{mbs} per rank micro-batch "
                                     "(the scripts at later commits)")
for size, tps in (("1B", 55000), ("7B", 10000), ("13B", 4600)):
    for precision, value in (("none", tps), ("tensorwise", {"1B": 65000, "7B": 13000, "13B": 5500}[size])):
        mbs = OLMO2_MBS[size]
        RUNS.append(Run(f"OLMo-2 {size}, {'bf16' if precision == 'none' else 'bf16/float8'}", "olmo-core", 64, value,
                        {"model.family": "olmo2", "model.flavor": size.lower(), "data.vocab_size": 100352}, 4096,
                        1024, dict(dp_replicate=8, dp_shard=8, micro_batch_size=mbs), float8=precision,
                        assumed=OLMO2_ASSUMED.format(mbs=f"{mbs} sequence{'s' if mbs > 1 else ''}")))


# -- MaxText: Llama 2 7B on A3 (8 x H100 80 GB per VM), TFLOP/s per chip -------------------------
def maxtext_llama2_7b_flops(seq: int = 4096) -> float:
    """MaxText's training FLOPs per token (calculate_tflops_training_per_device at e591f30):
    3 x (gated FFN + QKV + output projection per layer + unembedding) + 3 x causal attention."""
    d, f, layers, heads, hd, vocab = 4096, 11008, 32, 32, 128, 32000
    weights = layers * (2 * 3 * d * f + 2 * d * (heads + 2 * heads) * hd + 2 * d * heads * hd) + 2 * d * vocab
    attention = layers * 4 * seq * heads * hd / 2
    return 3 * (weights + attention)


LLAMA2_7B = {"model.family": "llama", "model.flavor": "3.1-8b", "model.overrides.n_kv_heads": 32,
             "model.overrides.ffn_dim": 11008, "model.overrides.n_layers": 32, "data.vocab_size": 32000}
for vms, tflops in ((1, 492), (2, 422), (4, 407), (8, 409), (16, 375)):
    RUNS.append(Run(f"Llama 2 7B, {vms} x A3, HSDP {8} x {vms}", "maxtext", 8 * vms,
                    tflops * 1e12 / maxtext_llama2_7b_flops(), LLAMA2_7B, 4096, 4 * 8 * vms,
                    dict(dp_replicate=vms, dp_shard=8, ac="selective", micro_batch_size=4), bf16_params=False,
                    assumed="remat 'minimal_with_context' as forja's op-level selective AC; XLA as compile; "
                            "fp32 weights gathered (weight_dtype float32)",
                    converted=f"{tflops} TFLOP/s/chip / MaxText's FLOPs per token (causal attention halved; if "
                              "the figures predate that rule, tokens/s is ~7% lower)"))


def config_sets(run: Run) -> list[str]:
    """The --set overrides of the run's job (its layout is built separately, as published)."""
    sets = {**run.model, "train.seq_len": run.seq, "train.global_batch_size": run.batch,
            "train.micro_batch_size": run.layout.get("micro_batch_size", 1), "train.float8": run.float8,
            "parallel.compile": run.compile_, "model.fused_ops": run.compile_,
            "parallel.mixed_precision": "bf16" if run.bf16_params else "fp32", **run.extra}
    if run.model.get("model.family") == "llama" and run.seq > 131072:
        sets["model.overrides.max_seq_len"] = run.seq
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sets.items()]


def hardware(kind: str, memory_gib: float | None) -> Hardware:
    """The table's device, or torchtitan's power-capped H100 (an H100 row with its own figures)."""
    if kind == "h100-500w":
        return replace(get_hardware("h100", memory_gib=memory_gib), **TITAN_HARDWARE)
    return get_hardware(kind, memory_gib=memory_gib)


def predict(run: Run) -> Candidate:
    """forja's prediction for the run's own layout."""
    cfg = load_config("configs/llama3-8b.toml", config_sets(run))
    kind, memory = run.gpu
    hw = hardware(kind, memory)
    job = job_from_config(cfg, gpu=True)
    return evaluate(job, Layout.of(**run.layout), hw)


@dataclass
class Result:
    run: Run
    predicted: float
    fits: bool
    peak_bytes: float = 0.0
    """The planner's per-rank peak for the run's layout."""
    refused_for_memory: bool = False
    """Whether forja's memory check refuses it (the validator accepts the layout)."""

    @property
    def log_ratio(self) -> float:
        """log(predicted / published): positive when forja predicts faster than measured."""
        return math.log(self.predicted / self.run.published)


def results(runs: list[Run] = RUNS) -> list[Result]:
    """Every expressible run, predicted."""
    out = []
    for run in runs:
        if run.inexpressible:
            continue
        c = predict(run)
        out.append(Result(run, c.tokens_per_sec_per_device, c.fits, c.memory.total, c.runs and not c.fits))
    return out


@dataclass
class Stats:
    """The error distribution of a set of rows (log ratios as `Result.log_ratio`)."""

    rows: int
    median_abs: float
    """Median |log(predicted / published)|: the typical row's error, either way."""
    worst_abs: float
    bias: float
    """Median signed log ratio: positive when the typical row is predicted too fast."""
    within_25: float
    """Share of rows with |predicted / published - 1| <= 0.25."""
    within_50: float

    @classmethod
    def of(cls, log_ratios: list[float]) -> Stats:
        x = log_ratios

        def share(tol: float) -> float:
            return sum(abs(math.exp(v) - 1) <= tol for v in x) / len(x)

        return cls(len(x), statistics.median(abs(v) for v in x), max(abs(v) for v in x), statistics.median(x),
                   share(0.25), share(0.5))


def summary(rows: list[Result]) -> dict[str, Stats]:
    """Per source repository and overall ("all")."""
    groups: dict[str, list[float]] = {"all": [r.log_ratio for r in rows]}
    for r in rows:
        groups.setdefault(REPOSITORY[r.run.source], []).append(r.log_ratio)
    return {k: Stats.of(v) for k, v in groups.items()}


# -- The validation criteria (tests/unit/plan/test_validation.py holds the model to them, and its
# mutation tests check that each fails when a term of the model is broken). Bounds are in
# natural-log units of predicted / published; each is a round figure with its reason, none read
# off the table.
MEDIAN_BOUND = 0.6
"""The typical row's error (median |log ratio|): docs/planner.md's promise since the table began."""
BIAS_BOUND = 0.5
"""The median signed log ratio, a factor e^0.5 = 1.65 either way. The model is a model of an
efficient stack (the best measured GEMM, attention and link rates, overlap where the schedule
allows it), and most rows come from stacks that leave time on the table: Megatron-LM's table is
predicted at +0.09, torchtitan's at +0.44 (issue #38). Beyond half a log unit the bias is no
longer the stacks' spread but the model's own."""
SOURCE_BOUND = math.log(2)
"""Every source repository's median |log ratio| within a factor of 2: a stack the model is
further from on its typical row is one it does not describe."""
BEST_SOURCE_BOUND = math.log(1.25)
"""Some source repository predicted within 25% on its median row: the model's rates are the
best the hardware is measured to do, and the table holds a stack built to reach them
(Megatron's); if no source comes within 25%, the model predicts faster than anything measured."""
PIPELINE_ROW_BOUND = math.log(2)
"""Each row whose pipeline bubble is material (below) within a factor of 2: off by more, the
planner would rank a pipelined layout against one whose step is half or twice as long."""
BUBBLE_SHARE = 0.1
"""A pipeline bubble is material when (pp - 1) / micro-batches, its size under 1F1B, is at least 10%."""
COMMUNICATION_BOUND = BIAS_BOUND
"""The median |log ratio| of the rows whose communication is on the critical path by construction
(below): no larger than the stacks' spread, or the communication model adds an error of its own."""


def bubble_bound(run: Run) -> bool:
    """A pipeline whose 1F1B bubble, (pp - 1) / micro-batches, is at least BUBBLE_SHARE of its
    busy time (read from the layout, not from the speed model)."""
    lay = Layout.of(**run.layout)
    return lay.pp > 1 and (lay.pp - 1) / lay.microbatches(run.batch) >= BUBBLE_SHARE


def communication_bound(run: Run) -> bool:
    """Synchronous TP over 4 or more ranks (each of a block's collectives moves at least 3/4 of
    its activations between dependent matmuls) or expert parallelism (the step waits on its
    all-to-alls): layouts whose communication is on the critical path whatever the stack."""
    tp, ep = run.layout.get("tp", 1), run.layout.get("ep", 1)
    return (tp >= 4 and not run.extra.get("parallel.async_tp")) or ep > 1


def validation_failures(rows: list[Result]) -> list[str]:
    """Each validation criterion the rows miss, as a sentence with the measured value; [] when all hold."""
    stats, out = summary(rows), []
    overall = stats.pop("all")
    if overall.median_abs > MEDIAN_BOUND:
        out.append(f"median |log ratio| {overall.median_abs:.3f} > {MEDIAN_BOUND}")
    if abs(overall.bias) > BIAS_BOUND:
        out.append(f"bias (median log ratio) {overall.bias:+.3f} beyond +-{BIAS_BOUND}")
    out += [f"{name}: median |log ratio| {s.median_abs:.3f} > {SOURCE_BOUND:.3f} (a factor 2)"
            for name, s in stats.items() if s.median_abs > SOURCE_BOUND]
    best = min(stats, key=lambda name: stats[name].median_abs)
    if stats[best].median_abs > BEST_SOURCE_BOUND:
        out.append(f"no source within 25% on its median row: the best, {best}, at {stats[best].median_abs:.3f} "
                   f"> {BEST_SOURCE_BOUND:.3f}")
    out += [f"pipeline row {r.run.name!r}: log ratio {r.log_ratio:+.3f} beyond +-{PIPELINE_ROW_BOUND:.3f}"
            for r in rows if bubble_bound(r.run) and abs(r.log_ratio) > PIPELINE_ROW_BOUND]
    comm = [r.log_ratio for r in rows if communication_bound(r.run)]
    if comm and Stats.of(comm).median_abs > COMMUNICATION_BOUND:
        out.append(f"communication-bound rows ({len(comm)}): median |log ratio| {Stats.of(comm).median_abs:.3f} "
                   f"> {COMMUNICATION_BOUND}")
    return out


def main() -> None:
    rows = results()
    print("| run | source | GPUs | GPU | published tok/s/GPU | predicted | log(pred/pub) "
          "| fits (forja's validator and memory) | assumed |")
    print("|---|---|---:|---|---:|---:|---:|---|---|")
    for r in rows:
        run = r.run
        pub = f"{run.published:,.0f}" + ("*" if run.converted else "")
        print(f"| {run.name} | {run.source} | {run.gpus} | {run.gpu[0]} | {pub} | {r.predicted:,.0f} | "
              f"{r.log_ratio:+.2f} | {'yes' if r.fits else 'no'} | {run.assumed or '-'} |")
    print("\n\\* converted from published TFLOP/s with the source's own FLOP formula (bench/plan_published.py).\n")
    print("| source | rows | median abs log ratio | worst abs log ratio | median log ratio (bias) | within 25% "
          "| within 50% |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in summary(rows).items():
        print(f"| {name} | {s.rows} | {s.median_abs:.3f} | {s.worst_abs:.3f} | {s.bias:+.3f} | {s.within_25:.0%} "
              f"| {s.within_50:.0%} |")
    failures = validation_failures(rows)
    print("\nValidation criteria (tests/unit/plan/test_validation.py): "
          + ("all hold." if not failures else "MISSED: " + "; ".join(failures)))
    memory_table(rows, rehearsed=rehearse_rows(rows) if "--rehearse" in sys.argv else {})
    left = [run for run in RUNS if run.inexpressible]
    print(f"\nLeft out ({len(left)} published rows forja cannot express):\n")
    for run in left:
        print(f"- {run.name} ({run.source}, {run.published:,.0f} tok/s/GPU): {run.inexpressible}")


def memory_table(rows: list[Result], rehearsed: dict[str, float]) -> None:
    """Per-rank peak memory: predicted, rehearsed (`--rehearse`) and published, beside what the
    memory check lets a rank use, and how many published runs forja's memory check refuses."""
    refused = [r for r in rows if r.refused_for_memory]
    fits = [r for r in refused if r.run.name in rehearsed and rehearsed[r.run.name] <= usable(r)]
    print(f"\nforja's memory check refuses {len(refused)} of {len(rows)} expressible published runs "
          f"({sum(r.run.published_gib is not None for r in refused)} of them with a published peak)"
          + (f"; the rehearsal fits {len(fits)} of them{': ' + ', '.join(r.run.name for r in fits) if fits else ''}"
             if rehearsed else "") + ".\n")
    print("| run | predicted GiB | rehearsed GiB (eager) | published GiB (reserved) | usable GiB | refused |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        if r.run.published_gib is None and r.run.name not in rehearsed and not r.refused_for_memory:
            continue
        reh = rehearsed.get(r.run.name)
        print(f"| {r.run.name} | {r.peak_bytes / 2 ** 30:.1f} | {'-' if reh is None else f'{reh / 2 ** 30:.1f}'} | "
              f"{r.run.published_gib or '-'} | {usable(r) / 2 ** 30:.1f} | "
              f"{'yes' if r.refused_for_memory else 'no'} |")


def usable(r: Result) -> float:
    """Bytes forja's memory check lets one rank of the run's device reach (forja/plan/planner.py)."""
    return usable_memory(hardware(*r.run.gpu))


def rehearse_rows(rows: list[Result]) -> dict[str, float]:
    """The rehearsed peak (the highest rank position's) of each row with a published peak or
    refused by the memory check, eager (forja/train/rehearse/)."""
    from forja.plan.layout import with_layout
    from forja.train.rehearse.rehearsal import rehearse

    out = {}
    for r in rows:
        if r.run.published_gib is None and not r.refused_for_memory:
            continue
        cfg = with_layout(load_config("configs/llama3-8b.toml", config_sets(r.run)), Layout.of(**r.run.layout))
        out[r.run.name] = max(rank.peak_bytes for rank in rehearse(cfg, r.run.gpus).ranks)
        print(f"rehearsed {r.run.name}: {out[r.run.name] / 2 ** 30:.1f} GiB", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    main()
