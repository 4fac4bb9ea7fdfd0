"""The side of bench/peers.py that runs inside each contender's process (forja, the plain
Hugging Face loop, torchtitan in its own environment). Needs only the standard library and
torch, so that every environment can import it.

Protocol, one JSON object per line: the harness starts `python bench/peers_<name>.py SPEC_JSON`;
the worker builds its model and optimizer, runs `spec["warmup"]` steps (compilation happens
there) and prints {"ready": ...}. Then for each {"steps": K} read on stdin it runs K steps and
prints {"seconds": ..., "peak_bytes": ..., "loss": ...}; for {"eval": WINDOWS_PATH} (bench/loss_race.py)
it prints {"held_out": ...}, its model scored by bench/race_eval.py's one evaluator; {"quit": true}
ends it. Logs go to stderr: stdout carries the protocol only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Contender:
    """What a worker's builder returns: `step()` runs one optimizer step on the next batch and
    returns the loss tensor (not synchronised: the round synchronises once at its end)."""
    step: Callable[[], torch.Tensor]
    params: int
    settings: dict = field(default_factory=dict)  # what this framework ran with, as it names it
    shims: list[str] = field(default_factory=list)  # what had to be changed to run it here
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    """tokens (B, T) -> the model's logits (B, T, V) in eval mode, for the loss race's evaluator."""


def token_batches(spec: dict, key: str = "tokens") -> torch.Tensor:
    """The run's token rows, [N, seq_len + 1] int64, the same file for every contender; with
    key "documents", the document id of each input token of those rows, [N, seq_len]."""
    rows = torch.load(spec[key])  # [N, seq_len + 1] or [N, seq_len]
    assert rows.shape[1] == spec["seq_len"] + (key == "tokens"), rows.shape
    return rows


def cycle_rows(spec: dict, device: torch.device, key: str = "tokens"):
    """An endless iterator over [batch, seq_len + 1] slices of the run's rows (on the host)."""
    return _cycle(token_batches(spec, key), spec["batch"])


def cycle_positions(spec: dict):
    """An endless iterator over the [batch, seq_len] positions of the batches cycle_rows gives:
    restarting at each document with spec["per_document"] (document_positions), else 0..T-1.
    Made once for all the rows, so that no step pays for them."""
    if not spec.get("per_document"):
        return itertools.repeat(torch.arange(spec["seq_len"]).expand(spec["batch"], -1))
    return _cycle(document_positions(token_batches(spec, "documents")), spec["batch"])


def _cycle(rows: torch.Tensor, batch: int):
    n = rows.shape[0] // batch
    i = 0
    while True:
        yield rows[(i % n) * batch:(i % n + 1) * batch]
        i += 1


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, T] each token's place in its document, 0 where one starts (and at a row's start):
    the per-document positions torchtitan's loaders give and transformers reads as packed
    rows. RoPE is relative, so a block sees the same rotations as with the row's positions."""
    T = documents.shape[1]
    idx = torch.arange(T, device=documents.device).expand_as(documents)  # [B, T]
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


def attended_pairs(mask, batch: int, seq_len: int, device: torch.device) -> dict:
    """Which (query, key) pairs of a batch a contender's attention lets through, read from the
    mask its own code built: None (causal SDPA, `is_causal`), a boolean tensor broadcast to
    (B, 1, T, T) (True: attends), or a FlexAttention BlockMask (its mask_mod evaluated on every
    pair). Returns their count and a digest of the whole (B, T, T) mask: the harness compares
    the digests, so every contender must do the same attention work, pair for pair."""
    if mask is None:
        dense = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    elif isinstance(mask, torch.Tensor):
        dense = mask.bool()
    else:
        from torch.nn.attention.flex_attention import create_mask

        dense = create_mask(mask.mask_mod, batch, 1, seq_len, seq_len, device=device)
    dense = dense.expand(batch, 1, seq_len, seq_len).reshape(batch, seq_len, seq_len).cpu()  # [B, T, T]
    digest = hashlib.sha1(dense.numpy().tobytes()).hexdigest()[:16]
    return {"attended_pairs": int(dense.sum()), "mask_digest": digest}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak RSS


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _host_settings(malloc: str) -> str:
    """The process settings forja's Trainer gives itself (forja/host.py: glibc's malloc
    thresholds, and torch's intra-op threads kept for the training thread), given to every
    contender alike before it builds, or to none ("system": the C library's defaults). Read
    from forja's source tree on the path, in every environment (torch is all it needs)."""
    if malloc == "system":
        return "the C library's malloc defaults, torch's threads as they start"
    from forja import host

    host.prepare_training_process(malloc)
    return f"malloc {host.malloc_applied()}, torch's intra-op threads confined to the training thread"


def serve(build: Callable[[dict], Contender]) -> None:
    """Build from the spec in argv[1], warm up, then answer the harness's rounds."""
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    host = _host_settings(spec.get("host", "system"))
    device = torch.device(spec["device"])
    protocol = sys.stdout
    sys.stdout = sys.stderr  # anything the framework prints stays off the protocol
    started = time.perf_counter()
    contender = build(spec)
    loss = None
    for _ in range(spec["warmup"]):  # 0 in the loss race: every step it trains is scored
        loss = contender.step()
    _sync(device)
    ready = {"ready": True, "build_s": round(time.perf_counter() - started, 2), "params": contender.params,
             "settings": {**contender.settings, "host": host}, "shims": contender.shims, "torch": torch.__version__,
             "warmup_loss": None if loss is None else float(loss)}
    print(json.dumps(ready), file=protocol, flush=True)
    windows: dict = {}  # held-out windows by path
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("quit"):
            break
        if "eval" in order:
            from race_eval import held_out_loss, load_windows

            if order["eval"] not in windows:  # read once: the race scores on them every round
                windows[order["eval"]] = load_windows(order["eval"])
            value = held_out_loss(contender.logits, windows[order["eval"]])
            print(json.dumps({"held_out": value}), file=protocol, flush=True)
            continue
        _reset_peak(device)
        _sync(device)
        start = time.perf_counter()
        for _ in range(order["steps"]):
            loss = contender.step()
        value = float(loss)  # the one host sync of the round
        _sync(device)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "peak_bytes": _peak_bytes(device), "loss": value}),
              file=protocol, flush=True)
