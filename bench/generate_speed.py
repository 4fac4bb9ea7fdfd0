"""Speed of forja's generation loop: KV-cache decoding against recomputing the whole prefix at
every token (the baseline), in fp32 and with `--quantize int8`; and the weights' bytes.

    python bench/generate_speed.py                          # random-weight Llama `debug`
    python bench/generate_speed.py --flavor tiny            # random-weight Llama `tiny`
    python bench/generate_speed.py --source runs/debug      # a run, a checkpoint or a HF directory
    python bench/generate_speed.py --prompt-tokens 16 --new-tokens 128 --rounds 5

Every variant decodes the same prompt (random token ids, seed 0) greedily for exactly
--new-tokens tokens (no stop token) through `forja.generate.generate`, so a timing is one whole
call: the prefill and every decoding step. The variants run in alternating rounds, after one
warm-up call each, so that a busy machine slows them alike; the table has each variant's median.
One torch thread by default (--threads).
It also checks that the cached and uncached loops give the same tokens, and prints
`weight_bytes` (forja/models/quantize.py) of the model in fp32, bf16 and int8.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.generate import SamplingConfig, generate  # noqa: E402
from forja.models import build_model  # noqa: E402
from forja.models.quantize import quantize, weight_bytes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=None, help="run dir, checkpoint or HF dir (default: random weights)")
    p.add_argument("--family", default="llama")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a shared 2-core machine, two threads contending with other "
                        "processes made single calls up to 9x slower)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    if args.source:
        from forja.checkpoint.export import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer(args.source)
        name = args.source
    else:
        model = build_model(args.family, args.flavor, seed=0)
        name = f"{args.family} {args.flavor} (random weights)"
    model.eval()
    int8 = quantize(copy.deepcopy(model), "int8")
    vocab = model.args.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(max_new_tokens=args.new_tokens)

    variants = {
        "fp32, KV cache": (model, True),
        "fp32, no cache (recompute)": (model, False),
        "int8, KV cache": (int8, True),
        "int8, no cache (recompute)": (int8, False),
    }
    outputs = {k: generate(m, prompt, cfg, use_cache=c) for k, (m, c) in variants.items()}  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for key, (m, use_cache) in variants.items():
            start = time.perf_counter()
            generate(m, prompt, cfg, use_cache=use_cache)
            times[key].append(time.perf_counter() - start)

    print(f"model: {name}, {model.num_params():,} parameters, max_seq_len {model.args.max_seq_len}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, greedy, median of {args.rounds} rounds\n")
    base = statistics.median(times["fp32, KV cache"])
    print("| variant | s per call | new tokens/s | time / fp32 KV cache |")
    print("|---|---:|---:|---:|")
    for key, ts in times.items():
        t = statistics.median(ts)
        print(f"| {key} | {t:.3f} | {args.new_tokens / t:,.0f} | {t / base:.2f}x |")
    for kind in ("fp32", "int8"):
        same = torch.equal(outputs[f"{kind}, KV cache"], outputs[f"{kind}, no cache (recompute)"])
        print(f"\n{kind}: cached and uncached tokens equal: {same}", end="")
    new = slice(args.prompt_tokens, None)
    agree = (outputs["fp32, KV cache"][0, new] == outputs["int8, KV cache"][0, new]).float().mean().item()
    print(f"\nint8 vs fp32 (KV cache): {agree:.0%} of the new tokens equal")

    bf16 = copy.deepcopy(model).bfloat16()
    sizes = {"fp32": weight_bytes(model), "bf16": weight_bytes(bf16), "int8": weight_bytes(int8)}
    print("\nweight_bytes: " + ", ".join(f"{k} {v:,} B" for k, v in sizes.items())
          + f"; int8 / bf16 = {sizes['int8'] / sizes['bf16']:.2f}")


if __name__ == "__main__":
    main()
