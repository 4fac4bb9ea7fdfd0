"""`forja prepare --part K --parts N` then `--merge`, against one `forja prepare`, on the stdlib.

What a worker costs and what the merge costs, like for like: every worker and the single
prepare use the same --workers (tokenizer processes). Each operation runs in a fresh
interpreter (imports not timed), the median of the repeats is reported, and every merge is
checked byte for byte against the single prepare's directory. Besides wall time, each
operation's CPU time (its own and its tokenizer processes') is reported: on a shared machine
it measures the work done, whatever else runs beside it.

    python bench/prepare_parts.py                       # trains an 8192-token BPE on stdlib first
    python bench/prepare_parts.py --tokenizer tok.json --repeats 3

Measured:
- "alone": the N workers one after another, each with the machine to itself, as on N
  machines: per-worker tokens/s, and the wall time N machines would take (slowest worker +
  merge) against the single prepare.
- "together": N = 2 workers at once with --workers 1 each (both cores busy), against one
  prepare with --workers 2: what splitting costs when the workers share a machine.
- the stdlib as one JSONL file, which is split in blocks of documents (every worker reads
  and parses the whole file, tokenizes its blocks), N = 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_one(op: str, source: str, tokenizer: str, out: str, workers: int, part: int, parts: int) -> dict:
    from forja.data import load_tokenizer, prepare

    tok = load_tokenizer(tokenizer)
    options: dict = {"workers": workers}
    if op == "part":
        options.update(part=part, parts=parts)
    elif op == "merge":
        options.update(merge=True)
    cpu, started = cpu_seconds(), time.perf_counter()
    result = prepare(source, tok, out, **options)
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    tokens = result.tokens if op == "part" else result.num_tokens("train") + result.num_tokens("val")
    return {"seconds": seconds, "cpu": cpu, "tokens": tokens}


def cpu_seconds() -> float:
    """User + system time of this process and its reaped children (the tokenizer processes, which
    prepare joins before it returns): the work done, whatever else the machine is running."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def launch(op: str, source: str, tokenizer: str, out: Path, workers: int, part: int = 0, parts: int = 0
           ) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--one", op, "--source", source, "--tokenizer", tokenizer,
                             "--out", str(out), "--workers", str(workers), "--part", str(part),
                             "--parts", str(parts)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"failed:\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def parted(source: str, tokenizer: str, out: Path, workers: int, n: int, together: bool, single: Path) -> dict:
    """N parts (one after another, or all at once) then the merge, checked against `single`."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    if together:
        procs = [launch("part", source, tokenizer, out, workers, k, n) for k in range(n)]
        parts = [result(p) for p in procs]
    else:
        parts = [result(launch("part", source, tokenizer, out, workers, k, n)) for k in range(n)]
    wall = time.perf_counter() - started
    merge = result(launch("merge", source, tokenizer, out, workers))
    if tree(out) != tree(single):
        raise SystemExit(f"the merge of {n} parts of {source} differs from the single prepare")
    return {"parts": parts, "merge": merge, "parts_wall": wall}


def single_run(source: str, tokenizer: str, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return result(launch("single", source, tokenizer, out, workers))


def stdlib_jsonl(path: Path) -> str:
    from forja.data.corpus.sources import SourceStats, parse_source

    with open(path, "w", encoding="utf-8") as f:
        for text in parse_source("stdlib").documents(SourceStats()):
            f.write(json.dumps({"text": text}) + "\n")
    return f"jsonl:{path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="tokenizer.json (default: train an 8192-token BPE on stdlib)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=("single", "part", "merge"), help=argparse.SUPPRESS)
    for name in ("--source", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--workers", "--part", "--parts"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.source, args.tokenizer, args.out, args.workers, args.part,
                                 args.parts)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = args.tokenizer
        if tokenizer is None:
            from forja.data import train_tokenizer

            tokenizer = str(root / "tokenizer.json")
            train_tokenizer("stdlib", vocab_size=8192, out=tokenizer)
        jsonl = stdlib_jsonl(root / "stdlib.jsonl")
        cases = [("stdlib", w, n, False) for w in (1, 2) for n in (1, 2, 4)] + [("stdlib", 1, 2, True)]
        cases += [(jsonl, 2, 2, False)]
        singles: dict[tuple[str, int], list[dict]] = {}
        runs: dict[tuple, list[dict]] = {case: [] for case in cases}
        for _ in range(args.repeats):
            for source, workers in sorted({(s, w) for s, w, _, _ in cases} | {("stdlib", 2)}):
                singles.setdefault((source, workers), []).append(
                    single_run(source, tokenizer, root / f"single-{workers}-{len(source)}", workers))
            for case in cases:
                source, workers, n, together = case
                reference = ("stdlib", 2) if together else (source, workers)
                runs[case].append(parted(source, tokenizer, root / "parted", workers, n, together,
                                         root / f"single-{reference[1]}-{len(reference[0])}"))
        report(singles, runs, args, jsonl)


def report(singles: dict, runs: dict, args: argparse.Namespace, jsonl: str) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"repeats {args.repeats}; every merge byte-identical to the single prepare; medians")
    name = {"stdlib": "stdlib", jsonl: "stdlib.jsonl"}
    med = statistics.median
    single = {key: (med(r["seconds"] for r in rs), med(r["cpu"] for r in rs), rs[0]["tokens"])
              for key, rs in singles.items()}
    print("| source | how | per worker M tokens/s (wall) | per worker CPU s | CPU of all parts / single "
          "| merge wall s | merge CPU s | merge / single (CPU) | slowest worker + merge, s (speed-up) "
          "| single wall s, CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (source, workers, n, together), rs in runs.items():
        ref = single[("stdlib", 2) if together else (source, workers)]
        rates = [med(r["parts"][k]["tokens"] / r["parts"][k]["seconds"] for r in rs) for k in range(n)]
        cpus = [med(r["parts"][k]["cpu"] for r in rs) for k in range(n)]
        merge_s, merge_cpu = med(r["merge"]["seconds"] for r in rs), med(r["merge"]["cpu"] for r in rs)
        how = (f"{n} workers at once, --workers {workers} (single: --workers 2)" if together
               else f"N={n} one after another, --workers {workers}")
        # On N machines the parts run at once: the slowest worker, then the merge.
        wall = med((r["parts_wall"] if together else max(p["seconds"] for p in r["parts"])) + r["merge"]["seconds"]
                   for r in rs)
        print(f"| {name[source]} | {how} | {', '.join(f'{x / 1e6:.2f}' for x in rates)} "
              f"| {', '.join(f'{x:.2f}' for x in cpus)} | {sum(cpus) / ref[1]:.2f} | {merge_s:.2f} | {merge_cpu:.2f} "
              f"| {merge_cpu / ref[1]:.1%} | {wall:.2f} ({ref[0] / wall:.2f}x) "
              f"| {ref[0]:.2f}, {ref[1]:.2f} ({ref[2] / ref[0] / 1e6:.2f} M tokens/s) |")


if __name__ == "__main__":
    main()
