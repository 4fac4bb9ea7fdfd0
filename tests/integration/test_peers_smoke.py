"""bench/peers.py at a tiny size: forja, the plain Hugging Face loop and torchtitan (its pinned
release, installed by the harness into a side environment over this one's torch) all build, train
on the same token rows and answer a round; the ratios come out. No timing is asserted: speed is
measured by the benchmark itself (bench/RESULTS.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ONLY = "forja eager,forja model alone (bare loop),HF loop eager,torchtitan eager"
MASKERS = "forja eager,HF loop eager,torchtitan eager"  # the bare loop builds forja's masks as the Trainer does


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_harness_runs_every_framework_and_computes_the_ratios(tmp_path, train_data):
    out = tmp_path / "peers"
    cmd = [sys.executable, "bench/peers.py", "--size", "smoke", "--rounds", "1", "--steps", "1", "--warmup", "1",
           "--only", ONLY, "--set", f"data.path={json.dumps(str(train_data))}", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "peers.json").read_text())
    rows = result["contenders"]
    assert set(rows) == set(ONLY.split(",")), rows.keys()
    # Every framework built the same shape and trained: one parameter count, finite losses.
    assert len({r["params"] for r in rows.values()}) == 1, {n: r["params"] for n, r in rows.items()}
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows.values()), rows
    pairs = {(p["forja"], p["peer"]): p["ratio"] for p in result["pairs"]}
    assert set(pairs) == {("forja eager", "HF loop eager"), ("forja eager", "torchtitan eager")}, pairs
    assert all(math.isfinite(r) and r > 0 for r in pairs.values()), pairs
    # Equal settings: every contender under the one host setting, the HF loop on fused AdamW
    # (TrainingArguments' default), torchtitan's parallelism read from what it built.
    assert len({r["settings"]["host"] for r in rows.values()}) == 1, {n: r["settings"] for n, r in rows.items()}
    assert "fused=True" in rows["HF loop eager"]["settings"]["optimizer"]
    assert all("causal" in r["settings"]["attention"] for r in rows.values()), rows
    # The same attention work: every contender's mask is causal, pair for pair.
    assert {r["settings"]["attended_pairs"] for r in rows.values()} == {2 * 32 * 33 // 2}, rows
    assert len({r["settings"]["mask_digest"] for r in rows.values()}) == 1, rows
    titan = rows["torchtitan eager"]
    assert "over a mesh of 1 rank" in titan["settings"]["parallelism_applied"], titan["settings"]
    assert titan["settings"]["torchtitan"] == "0.3.0", titan["settings"]
    assert titan["shims"], "the CPU shims torchtitan needed are listed"
    assert "| forja eager | torchtitan eager |" in (out / "peers.md").read_text()


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory, train_data) -> Path:
    """Prepared data of one-line documents (the json package's lines), so that the smoke size's
    32-token rows each pack several."""
    from forja.data import prepare
    from forja.data.corpus.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("short-documents")
    lines = [line.strip() for f in sorted(Path(json.__file__).parent.glob("*.py"))
             for line in f.read_text().splitlines() if line.strip()]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tok = Tokenizer.load(train_data.parent / "tokenizer.json")
    prepare(f"jsonl:{root / 'docs.jsonl'}", tok, root / "prepared", val_fraction=0.2, workers=1)
    return root / "prepared"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_framework_masks_the_same_documents(tmp_path, short_documents):
    """--attention documents (the 1b size's default, for a GPU): forja's document mask,
    torchtitan's FlexAttention block-causal masks and transformers' packed rows, each built by
    its own code for the first batch, let through the same (query, key) pairs: those of causal
    attention within each document of the loader's rows, and fewer than causal attention's."""
    import torch

    out = tmp_path / "peers"
    cmd = [sys.executable, "bench/peers.py", "--size", "smoke", "--warmup", "0", "--check-attention",
           "--attention", "documents", "--only", MASKERS, "--set", f"data.path={json.dumps(str(short_documents))}",
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "attention.json").read_text())
    assert set(result) == set(MASKERS.split(",")), result
    documents = torch.load(out / "documents.pt")[:2]  # [B, T]: the first batch's document ids
    expected = sum(n * (n + 1) // 2 for row in documents for n in torch.unique(row, return_counts=True)[1].tolist())
    assert expected < 2 * 32 * 33 // 2, "the first batch's rows each hold one document: nothing is checked"
    assert {r["attended_pairs"] for r in result.values()} == {expected}, result
    assert len({r["mask_digest"] for r in result.values()}) == 1, result
    assert "flex, block-causal" in result["torchtitan eager"]["attention"], result
