"""Activation memory per rank and step work under context parallelism, on CPU (Gloo): the
single-process step of one row against each cp kind at cp 2 and 4, at 8k-32k tokens.

    python bench/cp_memory.py                          # 8k, 16k, 32k; cp 1, 2, 4; ring and all-to-all
    python bench/cp_memory.py --seq-lens 8192 --cps 2

Activation memory is measured, not estimated: the bytes of every tensor autograd saves for
the backward during one forward (a saved-tensors hook, each storage counted once, the
parameters left out), on each rank. Step time is one forward + backward of one row on each
rank, one thread per rank; "rank-seconds" is cp x that, the work the whole group spends on
the row, so rank-seconds / the single process's is context parallelism's overhead (the
communication and the ring's unfused blocks). With more ranks than cores the ranks share
cores: their wall time includes waiting for each other's turn, so the overhead is an upper
bound there. The model is Llama-shaped (forja's llama family), causal attention without
document masks (the single process's dense mask would be T^2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from forja.models import build_model  # noqa: E402
from forja.testing import run_distributed  # noqa: E402

MODEL = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=512)


def _model():
    torch.manual_seed(0)
    return build_model("llama", "debug", **MODEL, max_seq_len=1 << 16)


def saved_bytes(model, run) -> int:
    """Bytes autograd saves for the backward while `run()` runs the forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    return loss, sum(storages.values())


def _measure(rank: int, world: int, kind: str | None, T: int, rounds: int, warmup: int) -> dict[str, float]:
    import torch.distributed as dist

    from forja.parallel.cp import ContextParallel

    torch.set_num_threads(1)
    model = _model()
    tokens = torch.randint(0, MODEL["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if kind is None:
        def forward():
            return model(inputs, labels=labels)
    else:
        part = ContextParallel(dist.new_group(list(range(world))), kind).split(inputs, labels, None)

        def forward():
            return model(part.tokens, positions=part.positions, labels=part.labels, sequence=part.sequence)
    times, memory = [], 0
    for _ in range(rounds + warmup):
        start = time.perf_counter()
        loss, memory = saved_bytes(model, forward)
        loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"saved_mb": memory / 2**20, "step_s": statistics.median(times[warmup:])}


def _single(rank: int, world: int, T: int, rounds: int, warmup: int) -> dict[str, float]:
    return _measure(rank, world, None, T, rounds, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=2, help="timed steps (their median is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    a = ap.parse_args()
    print(f"model: llama {MODEL}, torch {torch.__version__}, one thread per rank")
    print("| tokens | layout | activations saved per rank (MiB) | vs cp 1 | step time per rank (s) "
          "| rank-seconds vs cp 1 |")
    print("|---|---|---|---|---|---|")
    for T in a.seq_lens:
        base = run_distributed(_single, 1, T, a.rounds, a.warmup, timeout_s=3600)[0]
        print(f"| {T} | cp 1 | {base['saved_mb']:.1f} | 1.00 | {base['step_s']:.2f} | 1.00 |", flush=True)
        for cp in a.cps:
            for kind in ("ring", "all-to-all"):
                ranks = run_distributed(_measure, cp, kind, T, a.rounds, a.warmup, timeout_s=3600)
                mem = max(r["saved_mb"] for r in ranks)
                step = max(r["step_s"] for r in ranks)
                print(f"| {T} | {kind} cp {cp} | {mem:.1f} | {mem / base['saved_mb']:.3f} | {step:.2f} | "
                      f"{cp * step / base['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
