"""Tokens/s of `forja prepare` against Hugging Face `datasets` `map`, on the stdlib corpus.

Both sides start from the same files (the running interpreter's standard library, read and
decoded the same way), use the same tokenizer, the same number of processes, append the same
end-of-document token, and end with the token ids on disk: forja's shards, datasets' Arrow
cache. Each measurement runs in a fresh interpreter (imports are not timed), alternating
sides, and the median of the repeats is reported.

    python bench/prepare.py                      # trains an 8192-token BPE on stdlib first
    python bench/prepare.py --tokenizer tok.json --workers 2 --repeats 3

The datasets side is measured twice: with `encode_batch` (what most people write) and with
`encode_batch_fast` (what forja calls: no character offsets).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("forja", "datasets", "datasets-fast")


def run_forja(tokenizer: str, workers: int, out: Path) -> dict:
    from forja.data import load_tokenizer, prepare

    tok = load_tokenizer(tokenizer)
    started = time.perf_counter()
    ds = prepare("stdlib", tok, out / "prepared", workers=workers, val_fraction=0.0)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": ds.num_tokens("train"), "documents": ds.num_documents("train")}


def run_datasets(tokenizer: str, workers: int, out: Path, fast: bool) -> dict:
    import datasets
    import tokenizers

    from forja.data.corpus.sources import SourceStats, parse_source

    datasets.disable_progress_bars()
    tok = tokenizers.Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|eos|>")
    started = time.perf_counter()
    texts = list(parse_source("stdlib").documents(SourceStats()))
    data = datasets.Dataset.from_dict({"text": texts})

    def encode(batch: dict) -> dict:
        call = tok.encode_batch_fast if fast else tok.encode_batch
        return {"input_ids": [e.ids + [eos] for e in call(batch["text"], add_special_tokens=False)]}

    encoded = data.map(encode, batched=True, num_proc=workers, remove_columns=["text"],
                       cache_file_name=str(out / "map.arrow"))
    seconds = time.perf_counter() - started
    lengths = encoded.map(lambda b: {"n": [len(x) for x in b["input_ids"]]}, batched=True)["n"]
    return {"seconds": seconds, "tokens": int(sum(lengths)), "documents": len(encoded)}


def measure(side: str, tokenizer: str, workers: int) -> dict:
    """One measurement in a fresh interpreter."""
    done = subprocess.run([sys.executable, __file__, "--one", side, "--tokenizer", tokenizer,
                           "--workers", str(workers)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_default_tokenizer(directory: Path) -> str:
    from forja.data import train_tokenizer

    path = directory / "tokenizer.json"
    train_tokenizer("stdlib", vocab_size=8192, out=path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="tokenizer.json (default: train an 8192-token BPE on stdlib)")
    parser.add_argument("--workers", type=int, default=2, help="processes on both sides (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side (default 3)")
    parser.add_argument("--one", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.one:
            side, out = args.one, Path(tmp)
            result = (run_forja(args.tokenizer, args.workers, out) if side == "forja"
                      else run_datasets(args.tokenizer, args.workers, out, fast=side == "datasets-fast"))
            print(json.dumps(result))
            return
        tokenizer = args.tokenizer or train_default_tokenizer(Path(tmp))
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for _ in range(args.repeats):
            for side in SIDES:
                runs[side].append(measure(side, tokenizer, args.workers))
    report(runs, args)


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"workers {args.workers}, repeats {args.repeats}")
    rates = {}
    for side, results in runs.items():
        tokens = results[0]["tokens"]
        assert all(r["tokens"] == tokens for r in results)
        seconds = statistics.median(r["seconds"] for r in results)
        rates[side] = tokens / seconds
        spread = ", ".join(f"{r['seconds']:.2f}" for r in results)
        print(f"{side:14s} {results[0]['documents']:,} documents {tokens:,} tokens  median {seconds:.2f} s "
              f"({spread})  {rates[side] / 1e6:.2f} M tokens/s")
    if runs["forja"][0]["tokens"] != runs["datasets"][0]["tokens"]:
        print("warning: the two sides produced different token counts")
    for side in SIDES[1:]:
        print(f"forja / {side}: {rates['forja'] / rates[side]:.2f}x")


if __name__ == "__main__":
    main()
