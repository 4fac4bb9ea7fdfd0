"""forja against its peers, side by side in one run: torchtitan (its released package, in a side
environment) and a plain loop over `transformers`' LlamaForCausalLM, on the same device, Llama
shape, tokens, precision, batch and sequence length, at equal settings: every contender under the
same process settings (forja's host malloc and confined intra-op threads, or nobody's: --host),
the same attention for all (--attention: causal, or causal within the loader's documents, each
framework masking them its own way: forja's document mask, torchtitan's FlexAttention with
block-causal masks, transformers' packed rows; the pairs each one's mask lets through are
counted and must agree), the HF loop on fused AdamW as `TrainingArguments` sets it, forja's
recommended mode paired with each peer's fastest mode in the run.

    python bench/peers.py [--size cpu|smoke|1b] [--rounds 5] [--steps 5] [--only NAMES]
                          [--host forja|none] [--attention causal|documents] [--no-titan]
                          [--set KEY=VALUE ...] [--out runs/bench-peers]

Each contender is a process of its own (bench/peers_worker.py's protocol) that builds, compiles
and warms up once, then waits. On a CPU the rounds alternate: every round runs each contender for
--steps steps in turn, the order rotated each round, so that a slow minute of the machine falls
on all of them. On CUDA (--one-at-a-time) each contender runs its rounds alone and exits before
the next starts: four 1B trainings do not fit one GPU's memory together. Reported per contender: median tokens/s over
the rounds and its spread
(min-max), peak memory (CUDA: the allocator's peak in the round; CPU: the process's peak RSS)
and MFU. Pairs come first, as ratios of medians (forja / peer). The framework's overhead is
forja's Trainer step against forja's own model in a bare loop (bench/peers_forja.py --bare).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

# The sizes: forja's recipe and overrides (the shape every contender builds), batch, length, and
# the attention by default: on a GPU, each framework's own FlexAttention over packed documents
# (torchtitan's default); on a CPU, where FlexAttention is slow, causal SDPA for all.
SIZES = {
    "cpu": dict(recipe="default", sets=[], batch=8, seq_len=256, precision="fp32", attention="causal"),
    "smoke": dict(recipe="debug", batch=2, seq_len=32, precision="fp32", attention="causal",
                  sets=['model.overrides={dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, ffn_dim = 128}']),
    # Llama 3.2-1B with its 128,256-token vocabulary; the tokens come from a small tokenizer trained
    # on the embedded corpus (a GPU machine has no hub), which changes no shape.
    "1b": dict(recipe="llama3-1b", batch=1, seq_len=4096, precision="bf16", attention="documents",
               sets=["data.vocab_size=2048", "model.overrides={vocab_size = 128256}"]),
}
OPTIM = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}


@dataclass
class Entry:
    """One contender: a worker script, the interpreter that runs it and its spec changes."""
    name: str
    script: str
    changes: dict
    python: str = sys.executable
    proc: subprocess.Popen | None = None
    log: Path | None = None
    ready: dict = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)


def contenders(titan_python: str | None, only: set[str] | None) -> list[Entry]:
    """Matched settings (compile off, then on; no AC) and each framework's recommended ones."""
    out = [
        Entry("forja eager", "peers_forja.py", {"compile": False}),
        Entry("forja model alone (bare loop)", "peers_forja.py", {"compile": False, "bare": True}),
        Entry("forja compiled", "peers_forja.py", {"compile": True}),
        Entry("forja recommended (compile + fused ops)", "peers_forja.py",
              {"compile": True, "forja_extra": ["model.fused_ops=true"]}),
        Entry("HF loop eager", "peers_hf.py", {"compile": False}),
        Entry("HF loop compiled", "peers_hf.py", {"compile": True}),
        # Attribution, not a peer: the eager HF loop under the other host settings than the run's.
        Entry(ATTRIBUTION, "peers_hf.py", {"compile": False, "host": "other"}),
    ]
    if titan_python:
        out += [Entry("torchtitan eager", "peers_titan.py", {"compile": False}, python=titan_python),
                Entry("torchtitan compiled", "peers_titan.py", {"compile": True}, python=titan_python),
                Entry("torchtitan recommended (compile)", "peers_titan.py", {"compile": True, "recommended": True},
                      python=titan_python)]
    return [e for e in out if only is None or e.name in only]


ATTRIBUTION = "HF loop eager, the other host settings"
RECOMMENDED = "forja recommended (compile + fused ops)"
# (forja, peer): the ratios reported first, forja's tokens/s over the peer's. "fastest" pairs
# forja's recommended mode with the peer's fastest mode in this run (bench/peers.py, _fastest).
# The last pair is not a peer's: what the host settings alone give a plain loop.
PAIRS = [("forja eager", "HF loop eager"), ("forja compiled", "HF loop compiled"),
         (RECOMMENDED, "fastest HF loop"),
         ("forja eager", "torchtitan eager"), ("forja compiled", "torchtitan compiled"),
         (RECOMMENDED, "fastest torchtitan"),
         ("forja eager", ATTRIBUTION)]
# The host settings (bench/peers_worker.py): forja's, given to every contender, or nobody's.
HOSTS = {"forja": "retain", "none": "system"}


def model_shape(args, seq_len: int) -> dict:
    """The fields of forja's model args a peer builds the same shape from (its own layers and init)."""
    return {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
            "ffn_dim": args.ffn_dim, "vocab_size": args.vocab_size, "rope_theta": args.rope_theta,
            "norm_eps": args.norm_eps, "max_seq_len": max(args.max_seq_len, seq_len),
            "tie_embeddings": args.tie_embeddings}


def loader_rows(cfg, dataset, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `rows` rows forja's own loader trains the recipe on, in its order: tokens
    [rows, seq_len + 1] (a row's inputs and its last label: the labels are the inputs shifted,
    checked) and the document id of each input token [rows, seq_len]."""
    from forja.train.launch.data import loaders

    loader, _ = loaders(cfg, dataset, dp_rank=0, dp_size=1)
    taken, documents = [], []
    try:
        while sum(t.shape[0] for t in taken) < rows:
            for b in loader.next_step():
                # Every contender trains on a row's next tokens: forja's labels must be just that.
                assert torch.equal(b.labels[:, :-1], b.input_ids[:, 1:]), "labels are not the inputs shifted"
                taken.append(torch.cat([b.input_ids, b.labels[:, -1:].clamp(min=0)], dim=1))  # [m, T + 1]
                documents.append(b.document_ids)  # [m, T]
    finally:
        loader.close()
    return torch.cat(taken)[:rows].contiguous(), torch.cat(documents)[:rows].contiguous()


def shape_and_tokens(size: dict, sets: list[str], out: Path, rows: int) -> tuple[dict, dict, int, dict[str, str]]:
    """forja's model shape for the recipe, the Hugging Face config forja exports it as, its
    FLOPs per token, and `rows` token rows from forja's own loader (the same tokens for every
    contender) saved to out/tokens.pt, their document ids to out/documents.pt: the paths by name."""
    from forja.config import load_config
    from forja.models import build_from_args
    from forja.models.config import run_model_args
    from forja.models.llama.hf import config_from_args
    from forja.train.launch.data import data

    cfg = load_config(size["recipe"], [*size["sets"], *sets, f"train.seq_len={size['seq_len']}",
                                        f"train.global_batch_size={size['batch']}",
                                        f"train.micro_batch_size={size['batch']}"])
    tokenizer, dataset = data(cfg, rank=0)
    args = run_model_args(cfg.model, tokenizer.vocab_size)
    tokens, documents = loader_rows(cfg, dataset, rows)
    # The document ids: with --attention documents every contender masks them its own way.
    paths = {"tokens": str(out / "tokens.pt"), "documents": str(out / "documents.pt")}
    torch.save(tokens, paths["tokens"])
    torch.save(documents, paths["documents"])
    flops = build_from_args(args, device="meta").flops_per_token(size["seq_len"])
    return model_shape(args, size["seq_len"]), config_from_args(args), flops, paths


def run_spec(size: dict, sets: list[str], out: Path, *, device: str, host: str, warmup: int,
             per_document: bool) -> tuple[dict, int]:
    """What every contender's worker is started with (the shape, the token rows' paths, the
    precision, the host settings, the optimizer, the recipe and its overrides), and the model's
    FLOPs per token."""
    shape, hf_config, flops, paths = shape_and_tokens(size, sets, out, rows=size["batch"] * 8)
    spec = {"shape": shape, "hf_config": hf_config, "batch": size["batch"], "seq_len": size["seq_len"],
            **paths, "precision": size["precision"], "device": device, "ac": "none", "warmup": warmup,
            "threads": torch.get_num_threads(), "host": host, "optim": OPTIM, "seed": 0,
            "recipe": size["recipe"], "per_document": per_document, "forja_sets": [*size["sets"], *sets]}
    return spec, flops


def same_attention(entries: list[Entry]) -> None:
    """Stop, naming each contender's count, when the attention masks the started contenders
    built for the first batch let different (query, key) pairs through (their digests differ):
    they would not compute the same loss."""
    started = [e for e in entries if e.ready]
    if len({e.ready["settings"].get("mask_digest") for e in started}) > 1:
        counts = {e.name: (e.ready["settings"].get("attended_pairs"), e.ready["settings"].get("mask_digest"))
                  for e in started}
        raise SystemExit("the contenders' attention differs on the first batch ((query, key) pairs each one's "
                         f"mask lets through, and the masks' digests): {counts}")


def attention_check(entries: list[Entry], spec: dict, out: Path, timeout: float) -> dict:
    """--check-attention: each contender built in turn (one alive at a time), its attention on
    the first batch printed and written to out/attention.json, and compared (same_attention)."""
    try:
        for e in entries:
            start(e, spec, out, timeout)
            stop([e])
            print(f"  {e.name}: {e.ready['settings']['attention']}, {e.ready['settings']['attended_pairs']:,} "
                  "(query, key) pairs on the first batch", flush=True)
    finally:
        stop(entries)
    result = {e.name: {k: e.ready["settings"][k] for k in ("attention", "attended_pairs", "mask_digest")}
              for e in entries}
    (out / "attention.json").write_text(json.dumps(result, indent=1))
    same_attention(entries)
    return result


def send(entry: Entry, order: dict, timeout: float) -> dict:
    entry.proc.stdin.write(json.dumps(order) + "\n")
    entry.proc.stdin.flush()
    return _answer(entry, timeout)


def _answer(entry: Entry, timeout: float) -> dict:
    line = entry.proc.stdout.readline()
    if not line:
        entry.proc.wait(timeout=timeout)
        tail = entry.log.read_text()[-3000:] if entry.log else ""
        raise SystemExit(f"{entry.name} stopped (exit {entry.proc.returncode}); the end of {entry.log}:\n{tail}")
    return json.loads(line)


def start(entry: Entry, spec: dict, out: Path, timeout: float) -> None:
    entry.log = out / f"{entry.name.split(' (')[0].replace(' ', '-').replace(',', '')}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    full = {**spec, **entry.changes}
    if full.get("host") == "other":  # the attribution row: the host settings the run does not give
        full["host"] = "system" if spec["host"] == "retain" else "retain"
    full["forja_sets"] = [*spec["forja_sets"], *entry.changes.get("forja_extra", [])]
    entry.proc = subprocess.Popen([entry.python, str(BENCH / entry.script), json.dumps(full)], cwd=REPO, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(entry.log, "w"),
                                  text=True)
    entry.ready = _answer(entry, timeout)
    print(f"  {entry.name}: ready in {entry.ready['build_s']} s, {entry.ready['params']:,} parameters",
          flush=True)


def stop(entries: list[Entry]) -> None:
    """Ask each live worker to quit (it exits after its round), or kill it."""
    for e in entries:
        if e.proc is not None and e.proc.poll() is None:
            try:
                e.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                e.proc.stdin.flush()
                e.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                e.proc.kill()


def cpu_peak_flops(seconds: float = 2.0) -> float:
    """This CPU's fp32 matmul rate, measured: the MFU denominator on a CPU (no data sheet)."""
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - start)


def summarize(entries: list[Entry], tokens_per_step: int, steps: int, flops: int, peak: float) -> dict:
    rows = {}
    for e in entries:
        rates = [tokens_per_step * steps / r["seconds"] for r in e.rounds]
        median = statistics.median(rates)
        rows[e.name] = {"tokens_per_s": median, "spread": [min(rates), max(rates)], "rounds": rates,
                        "peak_gib": max(r["peak_bytes"] for r in e.rounds) / 2**30,
                        "mfu": flops * median / peak, "loss": e.rounds[-1]["loss"], "params": e.ready["params"],
                        "settings": e.ready["settings"], "shims": e.ready.get("shims", [])}
    fastest = {f"fastest {peer}": _fastest(rows, peer) for peer in ("HF loop", "torchtitan")}
    pairs = []
    for a, b in PAIRS:
        peer = fastest.get(b, b)
        if a in rows and peer in rows:
            pairs.append({"forja": a, "peer": peer if peer == b else f"{b} ({peer})",
                          "ratio": rows[a]["tokens_per_s"] / rows[peer]["tokens_per_s"]})
    out = {"pairs": pairs, "contenders": rows}
    if "forja eager" in rows and "forja model alone (bare loop)" in rows:
        bare, eager = rows["forja model alone (bare loop)"], rows["forja eager"]
        out["forja_overhead"] = bare["tokens_per_s"] / eager["tokens_per_s"] - 1
    return out


def _fastest(rows: dict, peer: str) -> str | None:
    """The name of the peer's fastest mode in this run (its eager, compiled or recommended row)."""
    modes = [name for name in rows if name.startswith(peer) and name != ATTRIBUTION]
    return max(modes, key=lambda name: rows[name]["tokens_per_s"]) if modes else None


def markdown(result: dict, header: str) -> str:
    lines = [header, "", "| forja | against | ratio (tokens/s) |", "|---|---|---|"]
    lines += [f"| {p['forja']} | {p['peer']} | {p['ratio']:.3f}x |" for p in result["pairs"]]
    if "forja_overhead" in result:
        lines += ["", f"forja's own overhead per step (Trainer step against its model in a bare loop): "
                      f"{100 * result['forja_overhead']:+.1f}%"]
    lines += ["", "| contender | tokens/s (median) | spread (min-max) | peak memory GiB | MFU | host settings |"
                  " attention | optimizer | parallelism applied |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["contenders"].items():
        lo, hi = r["spread"]
        s = r["settings"]
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {lo:,.0f}-{hi:,.0f} | {r['peak_gib']:.2f} | "
                     f"{100 * r['mfu']:.1f}% | {s.get('host', '-')} | {s.get('attention', '-')} "
                     f"({s.get('attended_pairs', 0):,} pairs) | "
                     f"{s.get('optimizer', '-')} | {s.get('parallelism_applied', '-')} |")
    shims = sorted({s for r in result["contenders"].values() for s in r["shims"]})
    if shims:
        lines += ["", "Shims torchtitan needed here: " + "; ".join(shims)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default="", help="contender names, comma-separated")
    p.add_argument("--no-titan", action="store_true", help="leave torchtitan out (no side environment)")
    p.add_argument("--wheels", default=None, help="install torchtitan offline from these wheels")
    p.add_argument("--host", choices=sorted(HOSTS), default="forja",
                   help="process settings for every contender alike: forja's (malloc thresholds, confined "
                        "intra-op threads) or none (the C library's defaults)")
    p.add_argument("--attention", choices=["causal", "documents"], default=None,
                   help="causal for every contender, or causal within each of the loader's documents "
                        "(default: the size's; documents at 1b)")
    p.add_argument("--check-attention", action="store_true",
                   help="only build every contender (no steps with --warmup 0) and compare the attention "
                        "each one's masks let through on the first batch; exit 1 when they differ")
    p.add_argument("--set", dest="sets", action="append", default=[], help="forja override for the shape")
    p.add_argument("--out", default="runs/bench-peers")
    p.add_argument("--timeout", type=float, default=900, help="seconds a worker may take to build")
    p.add_argument("--one-at-a-time", action="store_true", default=None,
                   help="each contender's rounds in turn, one process alive at a time (default on CUDA, "
                        "where four 1B trainings do not fit one GPU together)")
    args = p.parse_args(argv)
    size, out = SIZES[args.size], Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    titan = None
    if not args.no_titan:
        from peers_env import ensure_env
        titan = str(ensure_env(wheels=args.wheels))
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    entries = contenders(titan, only)
    spec, flops = run_spec(size, args.sets, out, device=args.device, host=HOSTS[args.host], warmup=args.warmup,
                           per_document=(args.attention or size["attention"]) == "documents")
    print(f"peers: {args.size} on {args.device}, shape {spec['shape']}, batch {size['batch']} x {size['seq_len']}, "
          f"attention {args.attention or size['attention']}", flush=True)
    if args.check_attention:
        return attention_check(entries, spec, out, args.timeout)
    one_at_a_time = args.device != "cpu" if args.one_at_a_time is None else args.one_at_a_time
    try:
        if one_at_a_time:
            for e in entries:
                start(e, spec, out, args.timeout)
                same_attention(entries)
                e.rounds = [send(e, {"steps": args.steps}, args.timeout) for _ in range(args.rounds)]
                stop([e])
        else:
            for e in entries:
                start(e, spec, out, args.timeout)
                same_attention(entries)
            for r in range(args.rounds):
                for e in entries[r % len(entries):] + entries[:r % len(entries)]:
                    e.rounds.append(send(e, {"steps": args.steps}, args.timeout))
    finally:
        stop(entries)
    peak = cpu_peak_flops() if args.device == "cpu" else 790e12  # H200 bf16, measured (issue #27)
    result = summarize(entries, size["batch"] * size["seq_len"], args.steps, flops, peak)
    result["meta"] = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                      "cpu_count": os.cpu_count(), "device": args.device, "torch": torch.__version__,
                      "command": " ".join(["python bench/peers.py", *(argv if argv is not None else sys.argv[1:])]),
                      "size": args.size, "rounds": args.rounds, "steps": args.steps, "peak_flops": peak,
                      "flops_per_token": flops}
    header = (f"{result['meta']['date']}, {args.device} ({os.cpu_count()} cores), torch {torch.__version__}, "
              f"`{result['meta']['command']}`")
    text = markdown(result, header)
    (out / "peers.json").write_text(json.dumps(result, indent=1))
    (out / "peers.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
