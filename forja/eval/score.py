"""Scoring a causal language model on tasks: log-likelihoods of continuations, as
lm-evaluation-harness computes them (Gao et al., 2021, EleutherAI/lm-evaluation-harness).

    reqs = choice_requests(tok, example, prefix_id=tok.eos_id, max_len=model.args.max_seq_len)
    lls = loglikelihoods(model, reqs)                    # one float per request, natural log
    evaluate(model, tok, task, prefix_id=tok.eos_id)     # {"acc": ..., "acc_norm": ...} or ppl, bits/byte

A `Request` is a token sequence whose last `n_scored` tokens are scored, each given every
token before it. Requests are batched with right padding: forja's models take no attention
mask, but attention is causal, so padding after a row's last real token never changes the
logits of the positions read. Pure functions of the model; nothing here writes files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from forja.data.tokenizer import Tokenizer
from forja.errors import ForjaError
from forja.eval.tasks import MULTIPLE_CHOICE, Choice, Task, Text


@dataclass(frozen=True)
class Request:
    """Score the last `n_scored` of `tokens`, each given all the tokens before it."""

    tokens: tuple[int, ...]
    n_scored: int


def _check(request: Request, max_len: int) -> None:
    if not 1 <= request.n_scored < len(request.tokens):
        raise ForjaError(f"a request of {len(request.tokens)} tokens cannot score {request.n_scored} of them; "
                         "score at least one token and leave at least one before it")
    if len(request.tokens) - 1 > max_len:
        raise ForjaError(f"a request of {len(request.tokens)} tokens is longer than the model's max_seq_len "
                         f"({max_len}) + 1; build requests with choice_requests/text_requests, which truncate")


def _score_batch(model: torch.nn.Module, batch: Sequence[Request], device: torch.device) -> list[float]:
    """Summed log-probs of each request's scored tokens, in one forward pass."""
    T = max(len(r.tokens) for r in batch) - 1
    inputs = torch.zeros(len(batch), T, dtype=torch.long)  # (B, T); zeros are right padding
    for row, r in enumerate(batch):
        inputs[row, : len(r.tokens) - 1] = torch.tensor(r.tokens[:-1])
    logits = model(inputs.to(device))  # (B, T, V)
    sums = []
    for row, r in enumerate(batch):
        end = len(r.tokens) - 1  # logits at position t predict token t + 1
        # log_softmax of the scored rows only: (n_scored, V) in float32, never (B, T, V)
        logp = logits[row, end - r.n_scored: end].float().log_softmax(-1)
        targets = torch.tensor(r.tokens[-r.n_scored:], device=logp.device)  # (n_scored,)
        sums.append(logp.gather(-1, targets[:, None]).double().sum().item())
    return sums


@torch.no_grad()
def loglikelihoods(model: torch.nn.Module, requests: Sequence[Request], *, batch_size: int = 16) -> list[float]:
    """Sum of natural-log probabilities of each request's scored tokens, in request order."""
    if batch_size < 1:
        raise ForjaError(f"batch_size={batch_size} must be at least 1")
    for r in requests:
        _check(r, model.args.max_seq_len)
    device = next(model.parameters()).device
    # Longest first, so each batch pads little.
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    out = [0.0] * len(requests)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start: start + batch_size]
            for i, value in zip(idx, _score_batch(model, [requests[i] for i in idx], device)):
                out[i] = value
    finally:
        model.train(was_training)
    return out


def choice_requests(tokenizer: Tokenizer, example: Choice, *, prefix_id: int | None,
                    max_len: int) -> list[Request]:
    """One request per choice: [prefix] + context tokens + choice tokens, scoring the choice's.

    As lm-evaluation-harness does, trailing whitespace of the context moves to the front of
    each choice (so "Answer: " + "4" is scored as "Answer:" + " 4", the way BPE splits text),
    and context and choice are encoded separately, so the scored tokens are exactly the
    choice's whatever the tokenizer would merge across the boundary. A sequence longer than
    max_len + 1 loses tokens from the left (the context's start).
    """
    context = example.context.rstrip()
    moved = example.context[len(context):]
    head = ([prefix_id] if prefix_id is not None else []) + tokenizer.encode(context)
    requests = []
    for choice in example.choices:
        tail = tokenizer.encode(moved + choice)
        if len(tail) > max_len or not head:
            why = "has no context or prefix token before it" if not head else f"is over {max_len} tokens"
            raise ForjaError(f"choice {choice[:40]!r} {why}, so the model cannot score it; "
                             "shorten the choice or give a context")
        tokens = tuple(head + tail)[-(max_len + 1):]
        requests.append(Request(tokens=tokens, n_scored=len(tail)))
    return requests


def text_requests(tokenizer: Tokenizer, text: str, *, prefix_id: int | None, max_len: int) -> list[Request]:
    """Every token of `text` scored once, in non-overlapping windows of max_len predictions.

    The first window starts from the prefix token; each later window starts from the last
    token of the one before, so it predicts its tokens from at most max_len tokens of its own
    (less context than a sliding window gives, and cheaper). Without a prefix token the text's
    first token has nothing before it and is not scored.
    """
    ids = ([prefix_id] if prefix_id is not None else []) + tokenizer.encode(text)
    return [Request(tokens=tuple(ids[s: s + max_len + 1]), n_scored=len(ids[s: s + max_len + 1]) - 1)
            for s in range(0, len(ids) - 1, max_len)]


# How a batch of requests becomes log-likelihoods: `loglikelihoods` on one process; the
# trainer's in-loop evaluation passes one that splits the requests over data-parallel ranks.
Scorer = Callable[..., list[float]]


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal maxima


def evaluate_multiple_choice(model: torch.nn.Module, tokenizer: Tokenizer, examples: Sequence[Choice], *,
                             prefix_id: int | None, batch_size: int = 16,
                             score: Scorer = loglikelihoods) -> dict[str, float]:
    """acc: the choice of highest summed log-likelihood is the answer; acc_norm: the same with
    each log-likelihood divided by its choice's length in UTF-8 bytes (the harness's acc_norm)."""
    max_len = model.args.max_seq_len
    per_example = [choice_requests(tokenizer, ex, prefix_id=prefix_id, max_len=max_len) for ex in examples]
    lls = score(model, [r for reqs in per_example for r in reqs], batch_size=batch_size)
    correct = correct_norm = 0
    start = 0
    for ex in examples:
        scores = lls[start: start + len(ex.choices)]
        start += len(ex.choices)
        correct += _argmax(scores) == ex.answer
        correct_norm += _argmax([s / len(c.encode("utf-8")) for s, c in zip(scores, ex.choices)]) == ex.answer
    n = len(examples)
    return {"n": n, "acc": correct / n, "acc_norm": correct_norm / n}


def evaluate_perplexity(model: torch.nn.Module, tokenizer: Tokenizer, examples: Sequence[Text], *,
                        prefix_id: int | None, batch_size: int = 16, score: Scorer = loglikelihoods) -> dict[str, float]:
    """loss: mean negative log-likelihood per scored token (nats); ppl = exp(loss);
    bits_per_byte: total NLL / (ln 2 x the texts' UTF-8 bytes), comparable across tokenizers."""
    max_len = model.args.max_seq_len
    requests = [r for ex in examples for r in text_requests(tokenizer, ex.text, prefix_id=prefix_id,
                                                             max_len=max_len)]
    nll = -sum(score(model, requests, batch_size=batch_size))
    tokens = sum(r.n_scored for r in requests)
    n_bytes = sum(len(ex.text.encode("utf-8")) for ex in examples)
    if tokens == 0:
        raise ForjaError("the texts have no token to score (a one-token text without a prefix token); "
                         "give longer texts")
    loss = nll / tokens
    return {"n": len(examples), "tokens": tokens, "bytes": n_bytes, "loss": loss, "ppl": math.exp(loss),
            "bits_per_byte": nll / (math.log(2) * n_bytes)}


def evaluate(model: torch.nn.Module, tokenizer: Tokenizer, task: Task, *, prefix_id: int | None,
             batch_size: int = 16, score: Scorer = loglikelihoods) -> dict[str, float]:
    """The metrics of one task, with its name and kind."""
    run = evaluate_multiple_choice if task.kind == MULTIPLE_CHOICE else evaluate_perplexity
    metrics = run(model, tokenizer, task.examples, prefix_id=prefix_id, batch_size=batch_size, score=score)
    return {"task": task.name, "kind": task.kind, **metrics}
