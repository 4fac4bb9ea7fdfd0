"""What forja's eager step runs against the plain Hugging Face loop's, op by op, at equal
settings (the default recipe's Llama shape, 8 x 256 tokens, fp32, the same weights' shapes).

    python bench/step_profile.py --rounds 6

Prints each model's median forward + backward (the two taking turns, so the machine's other
work falls on both), then the profiler's top operators of each over 3 steps: the calls and the
self time per operator, which show whether forja's step does any work the other does not. Last,
whether one wider matmul for q/k/v and for w1/w3 (the fusion a faster eager step would need)
beats the separate ones on this machine, forward and backward at the shape's sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forja.models.llama.hf import config_from_args  # noqa: E402
from forja.models.registry import build_from_args, model_args  # noqa: E402


def models(flavor: str):
    """forja's Llama of `flavor` and transformers' LlamaForCausalLM of the config forja exports."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args = model_args("llama", flavor)
    cfg = {k: v for k, v in config_from_args(args).items() if k not in ("architectures", "model_type")}
    return build_from_args(args), LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa")), args


def median_ms(steps: dict, rounds: int) -> dict[str, float]:
    """Each step's median wall time over `rounds`, the steps taking turns."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def fusion(dim: int, widths: list[int], tokens: int, rounds: int) -> dict[str, float]:
    """Forward + backward of x (tokens, dim) through the projections one by one, and through
    q/k/v and w1/w3 each as one wider matmul (widths: q, k, v, w1, w3)."""
    x = torch.randn(tokens, dim, requires_grad=True)
    apart = [torch.randn(n, dim, requires_grad=True) for n in widths]
    joined = [torch.randn(sum(widths[:3]), dim, requires_grad=True), torch.randn(sum(widths[3:]), dim,
                                                                                   requires_grad=True)]

    def run(weights):
        return lambda: sum((x @ w.t()).sum() for w in weights).backward()

    steps = {"separate": run(apart), "fused": run(joined)}
    for step in steps.values():
        step()
    return median_ms(steps, rounds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    forja_model, hf_model, margs = models(args.flavor)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, margs.vocab_size, (args.batch, args.seq_len + 1), generator=gen)  # (B, T + 1)
    inputs, labels = rows[:, :-1], rows[:, 1:].flatten()

    def forja_step():
        F.cross_entropy(forja_model(inputs).flatten(0, 1), labels).backward()

    def hf_step():
        F.cross_entropy(hf_model(input_ids=inputs).logits.flatten(0, 1).float(), labels).backward()

    steps = {"forja": forja_step, "HF loop": hf_step}
    for step in [*steps.values(), *steps.values()]:
        step()
    for name, ms in median_ms(steps, args.rounds).items():
        print(f"{name}: {ms:.1f} ms forward + backward")
    from torch.profiler import profile

    for name, step in steps.items():
        with profile() as prof:
            for _ in range(3):
                step()
        print(f"{name}, 3 steps:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    kv = margs.n_kv_heads * margs.head_dim
    widths = [margs.n_heads * margs.head_dim, kv, kv, margs.ffn_dim, margs.ffn_dim]
    ms = fusion(margs.dim, widths, args.batch * args.seq_len, 30)
    print(f"q/k/v and w1/w3: separate {ms['separate']:.2f} ms, fused {ms['fused']:.2f} ms (forward + backward)")


if __name__ == "__main__":
    main()
