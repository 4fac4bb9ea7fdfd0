"""Does forja's data loader keep up with training? Tokens/s of the loader alone, against one
rank's consumption at the 8B recipe on 8 GPUs and against nanoGPT's memmap window reader.

    python bench/loader.py                       # 200k documents (~90M tokens), ~12 s per row
    python bench/loader.py --docs 20000 --seconds 3   # a quick look

What it does, all in a temporary folder removed at the end:
  - writes a synthetic prepared corpus with forja's own ShardWriter and meta.json: `--docs`
    documents of lognormal lengths (median `--median` tokens, sigma `--sigma`: a long tail, some
    documents longer than a sample), random uint16 token ids, each document ending in EOS; 1%
    of the documents form the validation split;
  - times the index each packing builds on first use (bos, best-fit), alone, per million
    documents and per billion tokens;
  - runs the loader as rank 0 of 8 (dp_world_size 8) at configs/llama3-8b.toml's seq_len,
    global_batch_size and micro_batch_size, prefetch 0 (every byte of work is on the clock),
    for window, bos and best-fit; one step first (index build, page faults), then steps until
    `--seconds` have passed; tokens/s = input tokens returned / seconds (padding included: the
    best-fit row also gives the share that is real tokens);
  - the same from an S3 server on localhost (moto, started in its own process and stopped at
    the end; the corpus uploaded with forja.storage.upload_dir): a fresh block cache per
    packing, the first `--cold-steps` steps as the cold pass (blocks fetched from the server),
    then the warm steady state; and one step through a cache of 3.5 blocks ("every read a
    miss": a corpus far larger than the cache, read in shuffled order), 8 and 1 MiB blocks;
  - the baseline, nanoGPT's `get_batch` (train.py): a new np.memmap of the same token file
    each call, random offsets, `torch.stack` of `torch.from_numpy(...astype(int64))` for x and y,
    one call per micro-batch of `micro_batch_size` rows, so the same rows per step as forja;
  - the consumption: `forja plan`'s predicted tokens/s for the recipe on 8 H100s among the
    pure data-parallel layouts (the loader's 8 ranks), divided by 8 (each rank's loader builds
    only its own share). A model's prediction, not a measurement (docs/planner.md).
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import forja  # noqa: E402
from forja.data.corpus.prepare import DEFAULT_SHARD_TOKENS  # noqa: E402
from forja.data.corpus.shards import FORMAT, FORMAT_VERSION, META, ShardWriter, open_prepared, write_json  # noqa: E402
from forja.data.load.loader import DataLoader  # noqa: E402
from forja.data.load.packing import IGNORE, build_packing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "llama3-8b.toml"
RANKS = 8
PACKINGS = ("window", "bos", "best-fit")


# -- the corpus ---------------------------------------------------------------------------------
def write_corpus(out: Path, docs: int, median: float, sigma: float, vocab: int, seed: int = 0) -> dict:
    """A prepared directory of `docs` synthetic documents; returns its meta.json."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), sigma, docs)), 2, 1 << 17).astype(np.int64)
    is_val = rng.random(docs) < 0.01
    dtype, eos = np.dtype("<u2"), vocab - 1
    writers = {s: ShardWriter(out, s, dtype, DEFAULT_SHARD_TOKENS) for s in ("train", "val")}
    for lo in range(0, docs, 20_000):  # ~10M tokens at a time
        part = lengths[lo:lo + 20_000]
        tokens = rng.integers(0, eos, int(part.sum()), dtype=np.uint16)
        tokens[np.cumsum(part) - 1] = eos  # every document ends in EOS, as prepare writes them
        val = np.repeat(is_val[lo:lo + 20_000], part)
        writers["val"].add(tokens[val], part[is_val[lo:lo + 20_000]])
        writers["train"].add(tokens[~val], part[~is_val[lo:lo + 20_000]])
    spec = f"synthetic:docs={docs},median={median},sigma={sigma},vocab={vocab},seed={seed}"
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "forja_version": forja.__version__,
            "tokenizer": {"fingerprint": hashlib.sha256(spec.encode()).hexdigest(), "vocab_size": vocab,
                          "bos_id": None, "eos_id": eos, "pad_id": None},
            "dtype": dtype.name, "val_fraction": 0.01, "shard_tokens": DEFAULT_SHARD_TOKENS,
            "source": {"spec": spec, "fingerprint": hashlib.sha256(lengths.tobytes()).hexdigest(),
                       "documents": docs, "characters": int(lengths.sum()), "skipped_binary": 0,
                       "replaced_utf8": 0, "skipped_bad_lines": 0},
            "splits": {s: w.close() for s, w in writers.items()}}
    write_json(out / META, meta)
    return meta


# -- the consumption ------------------------------------------------------------------------------
def recipe() -> dict:
    import tomllib

    train = tomllib.loads(RECIPE.read_text())["train"]
    return {k: int(train[k]) for k in ("seq_len", "global_batch_size", "micro_batch_size")}


def predicted_consumption() -> dict:
    """`forja plan`'s best pure data-parallel layout of the recipe on 8 H100s."""
    layout = "parallel.dp_replicate=1,parallel.dp_shard=8,parallel.tp=1,parallel.pp=1,parallel.cp=1"
    cmd = [sys.executable, "-m", "forja", "plan", str(RECIPE), "--gpus", str(RANKS), "--gpu", "h100",
           "--json", "--layout", layout]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    best = max((c for c in json.loads(out)["candidates"] if c["fits"]), key=lambda c: c["tokens_per_sec"])
    return {"layout": best["description"], "tokens_per_s": best["tokens_per_sec"],
            "step_s": best["step_time_s"], "per_rank": best["tokens_per_sec"] / RANKS}


# -- measuring --------------------------------------------------------------------------------------
def run_steps(step, seconds: float, min_steps: int = 2) -> dict:
    """Call `step()` (returns (input tokens, real tokens)) until `seconds` pass; rates."""
    tokens = real = steps = 0
    start = time.perf_counter()
    while steps < min_steps or time.perf_counter() - start < seconds:
        t, r = step()
        tokens, real, steps = tokens + t, real + r, steps + 1
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": tokens / elapsed, "real_share": real / max(tokens, 1),
            "step_s": elapsed / steps, "steps": steps}


def loader_step(loader: DataLoader):
    def step() -> tuple[int, int]:
        batches = loader.next_step()
        return (sum(b.input_ids.numel() for b in batches),
                sum(int((b.labels != IGNORE).sum()) for b in batches))
    return step


def make_loader(data, packing: str, shape: dict) -> DataLoader:
    return DataLoader(data, seq_len=shape["seq_len"], global_batch_size=shape["global_batch_size"],
                      micro_batch_size=shape["micro_batch_size"], dp_rank=0, dp_world_size=RANKS, seed=0,
                      prefetch=0, packing=packing)


def local_rows(path: Path, shape: dict, seconds: float) -> list[dict]:
    rows = []
    data = open_prepared(path)
    for packing in PACKINGS:
        loader = make_loader(data, packing, shape)
        started = time.perf_counter()
        loader_step(loader)()  # builds the packing's index on first use
        first = time.perf_counter() - started
        rows.append({"source": "local", "packing": packing, "first_s": first,
                     **run_steps(loader_step(loader), seconds)})
    return rows


def index_builds(path: Path, seq_len: int) -> tuple[list[dict], int, int]:
    """Each packing's index built alone, as the loader builds it on first use."""
    stream = open_prepared(path).split("train")
    out = []
    for packing in PACKINGS:
        started = time.perf_counter()
        packed = build_packing(packing, stream, seq_len, max_doc_tokens=0, buffer=4096, pad_id=0)
        seconds = time.perf_counter() - started
        # What the index holds in RAM per rank: its own arrays, not the memory maps of the data.
        held = sum(v.nbytes for v in vars(packed).values()
                   if isinstance(v, np.ndarray) and not isinstance(v, np.memmap))
        out.append({"packing": packing, "seconds": seconds, "samples": packed.count, "mib": held / 2**20,
                    "per_m_docs": seconds / stream.num_documents * 1e6,
                    "per_b_tokens": seconds / stream.num_tokens * 1e9})
    return out, stream.num_documents, stream.num_tokens


def nanogpt_rows(path: Path, shape: dict, seconds: float) -> dict:
    """nanoGPT's get_batch over the same token file: one call per micro-batch of the step."""
    T, m = shape["seq_len"], shape["micro_batch_size"]
    calls = shape["global_batch_size"] // (m * RANKS)
    gen = torch.Generator().manual_seed(0)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(path, dtype=np.uint16, mode="r")  # nanoGPT re-opens it each call
        ix = torch.randint(len(data) - T, (m,), generator=gen)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    def step() -> tuple[int, int]:
        n = sum(get_batch()[0].numel() for _ in range(calls))
        return n, n

    step()
    return {"source": "local", "packing": "nanoGPT memmap", "first_s": 0.0, **run_steps(step, seconds)}


# -- from an S3 server ------------------------------------------------------------------------------
class S3Server:
    """moto's S3 server on a free localhost port, in its own process (not competing for this
    process's GIL), with this process's environment pointed at it."""

    def __init__(self, home: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit("the moto S3 server did not start; is moto[server] installed in this venv?")
                time.sleep(0.1)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_SECURITY_TOKEN"):
            os.environ.pop(key, None)
        os.environ.update({"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "bench",
                           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                           "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
                           "AWS_EC2_METADATA_DISABLED": "true"})

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def s3_rows(local: Path, work: Path, shape: dict, seconds: float, cold_steps: int) -> tuple[list[dict], float]:
    from forja.storage import upload_dir

    server = S3Server(work)
    try:
        url = server.bucket("forja-bench") + "/prepared"
        started = time.perf_counter()
        upload_dir(local, url, last=[META])
        upload_s = time.perf_counter() - started
        rows = []
        for packing in PACKINGS:
            rows += cold_then_warm(url, work / f"cache-{packing}", packing, shape, seconds, cold_steps)
        for packing, block_mb in (("window", 8), ("best-fit", 8), ("window", 1)):
            rows.append(all_misses(url, work / f"cache-miss-{packing}-{block_mb}", packing, block_mb, shape))
        return rows, upload_s
    finally:
        server.stop()


def s3_loader(url: str, cache: Path, packing: str, shape: dict) -> tuple[DataLoader, float]:
    """A loader over `url` with a fresh, empty block cache in `cache`, its index built (timed)."""
    from forja.data.corpus.prepare import open_dataset

    os.environ["FORJA_CACHE"] = str(cache)
    loader = make_loader(open_dataset(url), packing, shape)
    started = time.perf_counter()
    loader._packing(0, shape["seq_len"])  # the index alone (from the offsets), off the cold clock
    return loader, time.perf_counter() - started


def cold_then_warm(url: str, cache: Path, packing: str, shape: dict, seconds: float, cold_steps: int) -> list[dict]:
    from forja.storage.blocks import default_cache

    loader, first = s3_loader(url, cache, packing, shape)
    blocks = default_cache()
    cold = run_steps(loader_step(loader), 0.0, min_steps=cold_steps)
    fetched = blocks.fetched
    warm = run_steps(loader_step(loader), seconds)
    shutil.rmtree(cache, ignore_errors=True)
    mib = fetched * blocks.block_size / 2**20
    return [{"source": "S3, cold cache", "packing": packing, "first_s": first, **cold,
             "note": f"first {cold['steps']} steps: {fetched} blocks ({mib:.0f} MiB) fetched"},
            {"source": "S3, warm cache", "packing": packing, "first_s": 0.0, **warm,
             "note": f"{blocks.fetched - fetched} more blocks fetched"}]


def all_misses(url: str, cache: Path, packing: str, block_mb: int, shape: dict) -> dict:
    """One step through a cache of 3.5 blocks: a row's reads share its blocks, but nearly every
    row fetches its own, as for a corpus far larger than the cache read in shuffled order."""
    from forja.storage.blocks import default_cache

    os.environ.update({"FORJA_BLOCK_MB": str(block_mb), "FORJA_CACHE_GB": str(block_mb * 3.5 / 1024)})
    try:
        loader, _ = s3_loader(url, cache, packing, shape)
        blocks = default_cache()
        got = run_steps(loader_step(loader), 0.0, min_steps=1)
    finally:
        os.environ.pop("FORJA_BLOCK_MB")
        os.environ.pop("FORJA_CACHE_GB")
        shutil.rmtree(cache, ignore_errors=True)
    rows = shape["global_batch_size"] // RANKS
    return {"source": f"S3, every read a miss ({block_mb} MiB blocks)", "packing": packing, "first_s": 0.0,
            **got, "note": f"{blocks.fetched} blocks fetched for {rows} rows, cache of 3.5 blocks "
                           f"({blocks.fetched * block_mb / got['step_s']:.0f} MiB/s from the server)"}


# -- the report -------------------------------------------------------------------------------------
def table(rows: list[dict], baseline: dict, need: dict, shape: dict) -> str:
    base = baseline["tokens_per_s"]
    out = ["| reader | source | packing | vs nanoGPT | vs consumption/rank | tokens/s | real tokens | "
           f"s per step ({shape['global_batch_size'] // RANKS} rows) | steps | notes |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in [baseline] + rows:
        reader = "nanoGPT get_batch" if r is baseline else "forja DataLoader"
        note = r.get("note", "")
        if r.get("first_s"):
            note = (note + "; " if note else "") + f"first step / index {r['first_s']:.2f} s"
        out.append(f"| {reader} | {r['source']} | {r['packing']} | {r['tokens_per_s'] / base:.2f}x | "
                   f"{r['tokens_per_s'] / need['per_rank']:,.0f}x | {r['tokens_per_s'] / 1e6:.2f} M | "
                   f"{r['real_share']:.1%} | {r['step_s']:.3f} | {r['steps']} | {note} |")
    return "\n".join(out)


def build_table(builds: list[dict], docs: int, tokens: int) -> str:
    out = [f"| packing | index build s ({docs:,} documents, {tokens / 1e6:.1f} M tokens) | samples | "
           "s per million documents | s per billion tokens | index MiB in RAM | MiB per million documents |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for b in builds:
        out.append(f"| {b['packing']} | {b['seconds']:.3f} | {b['samples']:,} | {b['per_m_docs']:.2f} | "
                   f"{b['per_b_tokens']:.2f} | {b['mib']:.1f} | {b['mib'] / docs * 1e6:.1f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=200_000)
    p.add_argument("--median", type=float, default=300.0, help="median document length, tokens")
    p.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of document lengths")
    p.add_argument("--vocab", type=int, default=32768, help="token ids (uint16 on disk)")
    p.add_argument("--seconds", type=float, default=12.0, help="steady-state seconds per row")
    p.add_argument("--cold-steps", type=int, default=5, help="steps of the cold-cache pass from S3")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 rows")
    args = p.parse_args()
    shape, need = recipe(), predicted_consumption()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="forja-bench-loader-"))
    try:
        local = work / "prepared"
        meta = write_corpus(local, args.docs, args.median, args.sigma, args.vocab)
        written = time.perf_counter() - started
        builds, docs, tokens = index_builds(local, shape["seq_len"])
        (shard,) = meta["splits"]["train"]["shards"]  # one shard at forja's default shard size
        baseline = nanogpt_rows(local / shard["tokens"], shape, args.seconds)
        rows = local_rows(local, shape, args.seconds)
        upload_s = 0.0
        if not args.no_s3:
            s3, upload_s = s3_rows(local, work, shape, args.seconds, args.cold_steps)
            rows += s3
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus: {docs:,} train documents, {tokens:,} tokens (written in {written:.1f} s); "
          f"upload to S3 {upload_s:.1f} s; total {time.perf_counter() - started:.0f} s")
    print(f"recipe {RECIPE.name}: seq_len {shape['seq_len']}, global batch {shape['global_batch_size']}, "
          f"micro batch {shape['micro_batch_size']}; rank 0 of {RANKS}")
    print(f"consumption: forja plan, 8 x h100, {need['layout']}: {need['tokens_per_s']:,.0f} tokens/s "
          f"predicted (step {need['step_s']:.1f} s), {need['per_rank']:,.0f} per rank")
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs\n")
    print(table(rows, baseline, need, shape))
    print()
    print(build_table(builds, docs, tokens))


if __name__ == "__main__":
    main()
