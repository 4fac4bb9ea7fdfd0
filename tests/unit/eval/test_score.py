"""Scoring against `transformers`: the same weights and token ids give the same
log-likelihoods and bits per byte, whatever the batching and padding on forja's side."""

from __future__ import annotations

import math

import pytest
import torch

from forja.data.corpus.tokenizer import train_tokenizer
from forja.errors import ForjaError
from forja.eval import (
    Choice,
    Request,
    Text,
    choice_requests,
    evaluate_multiple_choice,
    evaluate_perplexity,
    loglikelihoods,
    text_requests,
)
from forja.eval.cli import load_model
from forja.models import build_model, save_hf_checkpoint

transformers = pytest.importorskip("transformers")

CORPUS = ["import json\n", "def dumps(obj, indent=None):\n    return JSONEncoder(indent=indent).encode(obj)\n",
          "class JSONDecodeError(ValueError):\n    pass\n", "for key, value in dct.items():\n    yield key\n"] * 4
MAX_LEN = 24  # small, so texts need several windows and long contexts are cut
EXAMPLES = [
    Choice(context="import json\n\ndata = json.", choices=("loads(text)", "sing(text)", "x"), answer=0),
    Choice(context="Answer: ", choices=("4", "four", " 5"), answer=1),  # trailing space moves to the choice
    Choice(context="def dumps(obj, indent=None):\n    return JSONEncoder(indent=indent).encode(obj)\n" * 2,
           choices=("class JSONDecodeError(ValueError):", "pass"), answer=0),  # context longer than MAX_LEN
]
TEXTS = [Text(CORPUS[1] * 3), Text("héllo → wörld\n"), Text("x")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(forja model loaded from the exported directory, tokenizer, prefix id, transformers' model)."""
    tok = train_tokenizer(CORPUS, vocab_size=300)
    out = tmp_path_factory.mktemp("eval") / "hf"
    save_hf_checkpoint(build_model("llama", "debug", seed=3, max_seq_len=MAX_LEN), out,
                       extra_files={"tokenizer.json": tok.to_str()})
    model, tok, prefix = load_model(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    return model, tok, prefix, hf


@torch.no_grad()
def hf_loglikelihood(hf, request: Request) -> float:
    """The reference: one unpadded sequence through transformers."""
    ids = torch.tensor([request.tokens[:-1]])
    logp = hf(ids).logits[0].double().log_softmax(-1)  # (T, V)
    targets = torch.tensor(request.tokens[1:])[-request.n_scored:]
    return logp[-request.n_scored:].gather(-1, targets[:, None]).sum().item()


def test_choice_requests_score_exactly_the_choice_tokens(setup):
    model, tok, prefix, _ = setup
    reqs = choice_requests(tok, EXAMPLES[1], prefix_id=prefix, max_len=MAX_LEN)
    for req, choice in zip(reqs, EXAMPLES[1].choices):
        assert list(req.tokens) == [prefix] + tok.encode("Answer:") + tok.encode(" " + choice)
        assert req.n_scored == len(tok.encode(" " + choice))
    long = choice_requests(tok, EXAMPLES[2], prefix_id=prefix, max_len=MAX_LEN)
    assert all(len(r.tokens) == MAX_LEN + 1 for r in long)  # cut from the left


def test_text_windows_score_every_token_once(setup):
    _, tok, prefix, _ = setup
    ids = [prefix] + tok.encode(TEXTS[0].text)
    reqs = text_requests(tok, TEXTS[0].text, prefix_id=prefix, max_len=MAX_LEN)
    assert len(reqs) == math.ceil((len(ids) - 1) / MAX_LEN) > 2
    assert [t for r in reqs for t in r.tokens[-r.n_scored:]] == ids[1:]
    assert all(len(r.tokens) <= MAX_LEN + 1 for r in reqs)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_loglikelihoods_match_transformers(setup, batch_size):
    model, tok, prefix, hf = setup
    reqs = [r for ex in EXAMPLES for r in choice_requests(tok, ex, prefix_id=prefix, max_len=MAX_LEN)]
    reqs += [r for t in TEXTS for r in text_requests(tok, t.text, prefix_id=prefix, max_len=MAX_LEN)]
    ours = loglikelihoods(model, reqs, batch_size=batch_size)  # right-padded batches of mixed lengths
    ref = [hf_loglikelihood(hf, r) for r in reqs]
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-4  # measured 1.2e-6 (float32, sums of up to 24 tokens)
    assert len(set(len(r.tokens) for r in reqs)) > 3  # the batches really mixed lengths


def test_accuracy_and_bits_per_byte_match_transformers(setup):
    model, tok, prefix, hf = setup
    result = evaluate_perplexity(model, tok, TEXTS, prefix_id=prefix, batch_size=3)
    reqs = [r for t in TEXTS for r in text_requests(tok, t.text, prefix_id=prefix, max_len=MAX_LEN)]
    nll = -sum(hf_loglikelihood(hf, r) for r in reqs)
    n_bytes = sum(len(t.text.encode()) for t in TEXTS)
    assert n_bytes > sum(len(t.text) for t in TEXTS)  # multi-byte characters count as bytes
    assert abs(result["bits_per_byte"] - nll / (math.log(2) * n_bytes)) < 1e-4
    assert result["tokens"] == sum(r.n_scored for r in reqs)
    assert abs(result["ppl"] - math.exp(nll / result["tokens"])) < 1e-3 * result["ppl"]

    mc = evaluate_multiple_choice(model, tok, EXAMPLES, prefix_id=prefix)
    expected_acc = expected_norm = 0
    for ex in EXAMPLES:
        lls = [hf_loglikelihood(hf, r) for r in choice_requests(tok, ex, prefix_id=prefix, max_len=MAX_LEN)]
        expected_acc += max(range(len(lls)), key=lls.__getitem__) == ex.answer
        norm = [ll / len(c.encode()) for ll, c in zip(lls, ex.choices)]
        expected_norm += max(range(len(norm)), key=norm.__getitem__) == ex.answer
    assert mc == {"n": 3, "acc": expected_acc / 3, "acc_norm": expected_norm / 3}


def test_a_request_longer_than_the_model_is_refused(setup):
    model = setup[0]
    with pytest.raises(ForjaError, match="longer than the model's max_seq_len"):
        loglikelihoods(model, [Request(tokens=tuple(range(MAX_LEN + 2)), n_scored=1)])
