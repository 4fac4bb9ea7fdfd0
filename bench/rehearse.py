"""Rehearsals at full size against the planner and against published runs (docs/planner.md,
"Rehearsal"): each case runs forja's build and one step on fake devices in this process.

    python bench/rehearse.py                 # every case (minutes on a 2-core CPU)
    python bench/rehearse.py --only 8B       # the cases whose name holds "8B" (or any of "8B,70B")
    python bench/rehearse.py --families      # every family's published flavors at one layout

Columns: the planner's per-rank peak for the rehearsed program (eager, no fused kernels:
what a fake tensor can run), the rehearsal's peak of live tensors on the rank position that
peaks highest, their error (a pipeline's other end: its own error beside it), and where a
run was published, its figure: torchtitan logs the caching allocator's reserved peak
(`torch.cuda.max_memory_reserved`, GiB), an upper bound on live tensors; the "as reserved"
column divides the rehearsed peak by forja's allocator term (forja/plan/planner.py,
FRAGMENTATION) to compare like with like. Published runs used torch.compile; the rehearsal
runs eager, which keeps more (a compiled block fuses and recomputes some of what eager saves).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.config import load_config  # noqa: E402
from forja.errors import ForjaError  # noqa: E402
from forja.plan.planner import FRAGMENTATION  # noqa: E402
from forja.train.rehearse.rehearsal import rehearse  # noqa: E402

GIB = 2 ** 30
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_8B = ["train.seq_len=8192", "model.attention=sdpa"]
# torchtitan's op-level selective AC keeps every second `mm` of a block's (forja's "alternate").
TITAN_SAC = ["parallel.ac=selective", "parallel.ac_matmuls=alternate"]


@dataclass
class Case:
    name: str
    recipe: str
    world: int
    sets: list[str]
    published_gib: float | None = None
    source: str = ""


CASES = [
    Case("8B FSDP 64, SAC (recipe)", "llama3-8b", 64, ["parallel.ac=selective"]),
    Case("8B FSDP 64, no AC", "llama3-8b", 64, ["parallel.ac=none"]),
    Case("8B FSDP 64, full AC", "llama3-8b", 64, ["parallel.ac=full"]),
    Case("8B FSDP 8 x TP 8, SAC", "llama3-8b", 64, ["parallel.dp_shard=8", "parallel.tp=8", "parallel.ac=selective"]),
    Case("8B FSDP 8, SAC, mbs 2 (torchtitan table 1, eager)", "llama3-8b", 8,
         TITAN_8B + TITAN_SAC + ["parallel.dp_shard=8", "train.micro_batch_size=2",
                                 "train.global_batch_size=16"], 82.4, TITAN),
    Case("8B FSDP 8, SAC, mbs 2, bf16 parameters (torchtitan table 1, eager)", "llama3-8b", 8,
         TITAN_8B + TITAN_SAC + ["parallel.dp_shard=8", "train.micro_batch_size=2",
                                 "train.global_batch_size=16", "parallel.mixed_precision=bf16"], 82.4, TITAN),
    Case("8B FSDP 128, SAC, mbs 2 (torchtitan table 3, eager)", "llama3-8b", 128,
         TITAN_8B + TITAN_SAC + ["parallel.dp_shard=128", "train.micro_batch_size=2",
                                 "train.global_batch_size=256"], 67.0, TITAN),
    Case("8B FSDP 4 x CP 2 all-to-all, 64k, full AC", "llama3-8b", 8,
         ["parallel.dp_shard=4", "parallel.cp=2", "parallel.cp_kind=all-to-all", "parallel.ac=full",
          "train.seq_len=65536", "train.micro_batch_size=1", "train.global_batch_size=4"]),
    Case("70B FSDP 32 x TP 8, full AC, mbs 16 (torchtitan table 4, bf16 eager)", "llama3-8b", 256,
         ["model.flavor=3.1-70b", "parallel.dp_shard=32", "parallel.tp=8", "parallel.ac=full",
          "train.micro_batch_size=16", "train.global_batch_size=512"] + TITAN_8B, 71.9, TITAN),
    # A pipeline: torchtitan's 405B row (its float8, compile and async TP are a compiled graph's:
    # rehearsed eager in bf16), each stage given its shapes (forja/parallel/pp.py).
    Case("405B FSDP 8 x TP 8 x PP 8, 1F1B x 8, full AC (torchtitan table 4, bf16 eager)", "llama3-8b", 512,
         ["model.flavor=3.1-405b", "parallel.dp_shard=8", "parallel.tp=8", "parallel.pp=8",
          "parallel.pp_microbatches=8", "parallel.ac=full", "parallel.mixed_precision=bf16",
          "train.micro_batch_size=1", "train.global_batch_size=256"] + TITAN_8B, 82.5, TITAN),
    # Megatron-LM's GPT 32B on 384 H100s with its distributed optimizer (parallel.grad_sync = "step").
    Case("GPT 32B TP 8 x FSDP 48, ZeRO-2, gradients once a step (Megatron-LM's distributed optimizer)", "llama3-8b",
         384, ["model.family=gpt2", "model.flavor=124m", "model.overrides.dim=7168", "model.overrides.n_layers=48",
               "model.overrides.n_heads=56", "model.overrides.ffn_dim=28672", "model.overrides.max_seq_len=4096",
               "data.vocab_size=131072", "train.seq_len=4096", "train.global_batch_size=192",
               "train.micro_batch_size=1", "parallel.mixed_precision=bf16", "parallel.dp_shard=48", "parallel.tp=8",
               "parallel.reshard_after_forward=false", "parallel.grad_sync=step"]),
    # The full DeepSeek-V3 (61 layers, 58 of them 256 routed experts) on 256 ranks, the experts
    # over 64 of them; routing balanced (forja/train/rehearse/routing.py).
    Case("DeepSeek-V3 671B FSDP 256, EP 64, full AC, 4k", "llama3-8b", 256,
         ["model.family=deepseek_v3", "model.flavor=671b", "parallel.dp_shard=256", "parallel.ep=64",
          "parallel.ac=full", "train.seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=256"]),
]


# Families whose attention is not the recipe's FlexAttention: sparse attention runs SDPA under a
# mask of the keys its indexer selects (forja/models/common/sparse_attention.py).
OWN_ATTENTION = {"deepseek_v32": ["model.attention=sdpa"], "glm5": ["model.attention=sdpa"]}


def family_cases() -> list[Case]:
    """Every published flavor of every family (not debug or tiny) at one representative layout:
    64 ranks of FSDP with op-level selective AC, 4,096 tokens a sequence, one a rank; a mixture of
    experts with its experts over 8 of them. Llama 3's vocabulary for every flavor."""
    from forja.models.registry import FAMILIES

    base = ["parallel.dp_shard=64", "parallel.ac=selective", "train.seq_len=4096", "train.micro_batch_size=1",
            "train.global_batch_size=64"]
    cases = []
    for family, spec in FAMILIES.items():
        for flavor, fields in spec.flavors.items():
            if flavor.startswith(("debug", "tiny")):
                continue
            moe = fields.get("n_experts", 0) > 0
            cases.append(Case(f"{family} {flavor}", "llama3-8b", 64,
                              base + [f"model.family={family}", f"model.flavor={flavor}"]
                              + (["parallel.ep=8"] if moe else []) + OWN_ATTENTION.get(family, [])))
    return cases


def run(case: Case) -> dict:
    began = time.perf_counter()
    r = rehearse(load_config(case.recipe, case.sets), case.world)
    pairs = sorted(zip(r.ranks, r.predicted), key=lambda rp: rp[0].peak_bytes, reverse=True)
    (rank, predicted), others = pairs[0], pairs[1:]
    other = "; ".join(f"{o.position} {p.total / o.peak_bytes - 1:+.1%}" for o, p in others) or "-"
    return {"case": case, "layout": r.layout, "rehearsed": rank.peak_bytes, "predicted": predicted.total,
            "other": other, "seconds": time.perf_counter() - began}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run the cases whose name holds this (or one of these, comma-separated)")
    p.add_argument("--families", action="store_true",
                   help="every published flavor of every family at one layout, instead of the cases above")
    args = p.parse_args()
    print("| case | ranks | layout | predicted GiB | rehearsed GiB | error | other rank position | as reserved GiB "
          "| published GiB | rehearsal s |")
    print("|---|---:|---|---:|---:|---:|---|---:|---:|---:|")
    for case in family_cases() if args.families else CASES:
        if not any(name.strip() in case.name for name in args.only.split(",")):
            continue
        try:
            row = run(case)
        except ForjaError as exc:  # a layout forja refuses, in its one sentence
            print(f"| {case.name} | {case.world} | refused: {exc} | | | | | | | |", flush=True)
            continue
        published = f"{case.published_gib:.1f}" if case.published_gib else "-"
        print(f"| {case.name} | {case.world} | {row['layout'].replace(' | ', ', ')} | {row['predicted'] / GIB:.2f} | "
              f"{row['rehearsed'] / GIB:.2f} | {row['predicted'] / row['rehearsed'] - 1:+.1%} | {row['other']} | "
              f"{row['rehearsed'] / FRAGMENTATION / GIB:.1f} | {published} | {row['seconds']:.0f} |", flush=True)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"\npeak host memory of this process: {peak_rss:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
