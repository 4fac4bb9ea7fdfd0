"""What forja's eager step runs against the plain Hugging Face loop's, op by op, at equal
settings (the default recipe's Llama shape, 8 x 256 tokens, fp32, the same weights' shapes).

    python bench/step_profile.py --rounds 6

Prints each model's median forward + backward (the two taking turns, so the machine's other
work falls on both), then the profiler's top operators of each over 3 steps: the calls and the
self time per operator, which show whether forja's step does any work the other does not. Last,
whether one wider matmul for q/k/v and for w1/w3 (the fusion a faster eager step would need)
beats the separate ones on this machine, forward and backward at the shape's sizes.

    python bench/step_profile.py --compile --rounds 8

compiles both models whole (`torch.compile`, each forward + backward one graph) and prints
each step against the shape's arithmetic floor: its matmuls (the blocks' seven projections and
the output layer, each forward and both backward products) and its attention (SDPA forward and
backward), timed alone at the step's sizes in the same run. No implementation of the same
arithmetic runs below that floor; what a step spends above it is the rest of its work
(embedding, norms, rotary, activation, loss, and the time between kernels).
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


def arithmetic_floor(margs, batch: int, seq_len: int, rounds: int) -> dict[str, float]:
    """The step's matmuls and attention timed alone (ms): every projection of a block and the
    output layer, forward (x W^T) and backward (dy W, dy^T x), times the layers; SDPA causal
    attention forward and backward at the shape's heads, times the layers."""
    tokens, dim, hd = batch * seq_len, margs.dim, margs.head_dim
    kv = margs.n_kv_heads * hd
    widths = [margs.n_heads * hd, kv, kv, margs.ffn_dim, margs.ffn_dim]
    # (in, out) of q, k, v, w1, w3, then o and w2
    shapes = [(dim, n) for n in widths] + [(margs.n_heads * hd, dim), (margs.ffn_dim, dim)]

    def matmuls(k: int, n: int):
        x, w, dy = torch.randn(tokens, k), torch.randn(n, k), torch.randn(tokens, n)
        return lambda: (x @ w.t(), dy @ w, dy.t() @ x)

    q = torch.randn(batch, margs.n_heads, seq_len, hd, requires_grad=True)  # (B, H, T, hd)
    k, v = (torch.randn(batch, margs.n_kv_heads, seq_len, hd, requires_grad=True) for _ in range(2))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    block = [matmuls(a, b) for a, b in shapes]
    steps = {"blocks' matmuls": lambda: [f() for f in block], "output layer's matmuls": matmuls(dim, margs.vocab_size),
             "attention": attention}
    for step in steps.values():
        step()
    ms = median_ms(steps, rounds)
    ms["blocks' matmuls"] *= margs.n_layers
    ms["attention"] *= margs.n_layers
    return ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="both models compiled whole, against the arithmetic floor")
    args = p.parse_args(argv)
    forja_model, hf_model, margs = models(args.flavor)
    if args.compile:
        forja_model, hf_model = torch.compile(forja_model), torch.compile(hf_model)
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
    timed = median_ms(steps, args.rounds)
    for name, ms in timed.items():
        print(f"{name}{' compiled' if args.compile else ''}: {ms:.1f} ms forward + backward")
    if args.compile:
        floor = arithmetic_floor(margs, args.batch, args.seq_len, args.rounds)
        total = sum(floor.values())
        print("arithmetic floor: " + ", ".join(f"{k} {v:.1f} ms" for k, v in floor.items()) + f"; {total:.1f} ms")
        for name, ms in timed.items():
            print(f"{name} compiled: {ms / total:.3f}x the floor")
        return
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
