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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from forja.data.corpus.tokenizer import Tokenizer
from forja.errors import ForjaError
from forja.eval.tasks import MULTIPLE_CHOICE, Choice, Task, Text


@dataclass(frozen=True)
class Request:
    """Score the last `n_scored` of `tokens`, each given all the tokens before it."""

    tokens: tuple[int, ...]
    n_scored: int


IGNORE = -100  # cross_entropy's ignore_index: positions not scored


class Score(NamedTuple):
    """What scoring one request gives."""

    logprob: float
    """The summed natural-log probability of its scored tokens."""
    greedy: bool | None
    """Whether each scored token is the model's most likely one there (lm-evaluation-harness's
    is_greedy); None where not computed: vocabulary-sharded logits would have to be gathered."""

def _check(request: Request, max_len: int) -> None:
    if not 1 <= request.n_scored < len(request.tokens):
        raise ForjaError(f"a request of {len(request.tokens)} tokens cannot score {request.n_scored} of them; "
                         "score at least one token and leave at least one before it")
    if len(request.tokens) - 1 > max_len:
        raise ForjaError(f"a request of {len(request.tokens)} tokens is longer than the model's max_seq_len "
                         f"({max_len}) + 1; build requests with choice_requests/text_requests, which truncate")


# What scores a batch: tokens (B, T) on the device -> logits (B, T, V), None on a rank that
# holds no logits (a pipeline rank without the last stage), or under tensor parallelism a
# DTensor sharded over the vocabulary, which is scored without gathering it (_sharded_sums).
Forward = Callable[[torch.Tensor], "torch.Tensor | None"]


def _score_batch(forward: Forward, batch: Sequence[Request], device: torch.device, pad_to: int) -> list[Score]:
    """The scores of a batch's requests, in one forward pass (0.0 and None each where `forward`
    returns None). The padded length is a multiple of `pad_to` (sequence
    parallelism splits it over the tensor-parallel ranks)."""
    T = max(len(r.tokens) for r in batch) - 1
    T = -(-T // pad_to) * pad_to
    inputs = torch.zeros(len(batch), T, dtype=torch.long)  # (B, T); zeros are right padding
    for row, r in enumerate(batch):
        inputs[row, : len(r.tokens) - 1] = torch.tensor(r.tokens[:-1])
    logits = forward(inputs.to(device))  # (B, T, V)
    if logits is None:
        return [Score(0.0, None)] * len(batch)
    if isinstance(logits, DTensor):
        return [Score(value, None) for value in _sharded_sums(logits, batch)]
    scores = []
    for row, r in enumerate(batch):
        end = len(r.tokens) - 1  # logits at position t predict token t + 1
        # log_softmax of the scored rows only: (n_scored, V) in float32, never (B, T, V)
        logp = logits[row, end - r.n_scored: end].float().log_softmax(-1)
        targets = torch.tensor(r.tokens[-r.n_scored:], device=logp.device)  # (n_scored,)
        scores.append(Score(logp.gather(-1, targets[:, None]).double().sum().item(),
                            bool((logp.argmax(-1) == targets).all())))
    return scores


def _sharded_sums(logits: DTensor, batch: Sequence[Request]) -> list[float]:
    """The same sums from logits (B, T, V) sharded over the vocabulary (tensor parallelism):
    vocabulary-parallel cross-entropy with every unscored position ignored gives each
    token's -log p from per-shard maxima and sums, so no rank holds the full (B, T, V)."""
    B, T, _ = logits.shape
    targets = torch.full((B, T), IGNORE, dtype=torch.long)  # (B, T)
    for row, r in enumerate(batch):
        end = len(r.tokens) - 1
        targets[row, end - r.n_scored: end] = torch.tensor(r.tokens[-r.n_scored:])
    with loss_parallel():
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().to(logits.device),
                              reduction="none", ignore_index=IGNORE)  # (B * T,)
    nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
    return (-nll.view(B, T).double().sum(-1)).tolist()


def score_requests(forward: Forward, requests: Sequence[Request], *, batch_size: int, device: torch.device,
                   max_len: int, pad_to: int = 1) -> list[Score]:
    """Each request's Score, through any forward: a model, or a sharded model's
    (forja/train/evaluation.py). Every rank calling it with the same number of requests
    makes the same number of forwards."""
    if batch_size < 1:
        raise ForjaError(f"batch_size={batch_size} must be at least 1")
    for r in requests:
        _check(r, max_len)
    # Longest first, so each batch pads little.
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    out: list[Score] = [Score(0.0, None)] * len(requests)
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        for i, value in zip(idx, _score_batch(forward, [requests[i] for i in idx], device, pad_to)):
            out[i] = value
    return out


@torch.no_grad()
def loglikelihoods(model: torch.nn.Module, requests: Sequence[Request], *, batch_size: int = 16) -> list[float]:
    """Sum of natural-log probabilities of each request's scored tokens, in request order."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        scores = score_requests(model, requests, batch_size=batch_size, device=device,
                                max_len=model.args.max_seq_len)
    finally:
        model.train(was_training)
    return [s.logprob for s in scores]


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


def evaluate_multiple_choice(model: torch.nn.Module | None, tokenizer: Tokenizer, examples: Sequence[Choice], *,
                             prefix_id: int | None, batch_size: int = 16, score: Scorer = loglikelihoods,
                             max_len: int | None = None) -> dict[str, float]:
    """acc: the choice of highest summed log-likelihood is the answer; acc_norm: the same with
    each log-likelihood divided by its choice's length in UTF-8 bytes (the harness's acc_norm)."""
    max_len = max_len or model.args.max_seq_len
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


def evaluate_perplexity(model: torch.nn.Module | None, tokenizer: Tokenizer, examples: Sequence[Text], *,
                        prefix_id: int | None, batch_size: int = 16, score: Scorer = loglikelihoods,
                        max_len: int | None = None) -> dict[str, float]:
    """loss: mean negative log-likelihood per scored token (nats); ppl = exp(loss);
    bits_per_byte: total NLL / (ln 2 x the texts' UTF-8 bytes), comparable across tokenizers."""
    max_len = max_len or model.args.max_seq_len
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


def evaluate(model: torch.nn.Module | None, tokenizer: Tokenizer, task: Task, *, prefix_id: int | None,
             batch_size: int = 16, score: Scorer = loglikelihoods, max_len: int | None = None) -> dict[str, float]:
    """The metrics of one task, with its name and kind. `score(model, requests, batch_size=)`
    computes the log-likelihoods; with one that does not need `model` (the trainer's, under
    pipeline parallelism no rank holds the whole model) pass model=None and `max_len`, the
    model's max_seq_len."""
    run = evaluate_multiple_choice if task.kind == MULTIPLE_CHOICE else evaluate_perplexity
    metrics = run(model, tokenizer, task.examples, prefix_id=prefix_id, batch_size=batch_size, score=score,
                  max_len=max_len)
    return {"task": task.name, "kind": task.kind, **metrics}
