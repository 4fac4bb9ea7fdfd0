"""Decoding: sampling, top-k / top-p, stop tokens, bad settings. Greedy decoding against
transformers' generate (cached and uncached) is every family's, in test_conformance.py."""

import pytest
import torch

from forja.errors import ForjaError
from forja.generate import SamplingConfig, _filter_logits, generate
from forja.models import build_model


def test_sampling_is_repeatable_by_seed_and_differs_across_seeds():
    model = build_model("llama", "debug", seed=0)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    cfg = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95)
    a = generate(model, prompt, SamplingConfig(seed=1, **cfg))
    b = generate(model, prompt, SamplingConfig(seed=1, **cfg))
    c = generate(model, prompt, SamplingConfig(seed=2, **cfg))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(_filter_logits(logits, **kw))[0].tolist()  # noqa: E731
    assert kept(top_k=2, top_p=None) == [True, True, False, False]
    assert kept(top_k=None, top_p=0.5) == [True, False, False, False]  # 0.5 alone reaches p
    assert kept(top_k=None, top_p=0.8) == [True, True, False, False]
    assert kept(top_k=None, top_p=0.81) == [True, True, True, False]
    shuffled = logits[:, [2, 0, 3, 1]]  # order must not matter
    assert torch.isfinite(_filter_logits(shuffled, None, 0.8))[0].tolist() == [False, True, False, True]


def test_stop_token_ends_rows_and_pads_them():
    model = build_model("llama", "debug", seed=0)
    prompt = torch.randint(0, 2048, (2, 3), generator=torch.Generator().manual_seed(0))
    free = generate(model, prompt, SamplingConfig(max_new_tokens=8))[:, 3:]
    stop = int(free[0, 2])
    out = generate(model, prompt, SamplingConfig(max_new_tokens=8, stop_token=stop))[:, 3:]
    for row in range(2):
        hits = (free[row] == stop).nonzero()
        end = int(hits[0]) if len(hits) else 8
        # Greedy decoding is prefix-consistent: the row is the free run cut at its first stop token.
        assert out[row, : end + 1].tolist() == free[row, : end + 1].tolist()
        assert (out[row, end:] == stop).all()
    if (free == stop).any(dim=1).all():  # every row stopped: the loop ends early
        assert out.shape[1] == int(max((r == stop).nonzero()[0] for r in free)) + 1


def test_bad_sampling_settings_and_too_long_requests():
    with pytest.raises(ForjaError, match="top_p=1.5 must be in"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ForjaError, match="temperature=-1"):
        SamplingConfig(temperature=-1)
    model = build_model("gpt2", "debug")
    with pytest.raises(ForjaError, match="exceeds the model's max_seq_len of 512"):
        generate(model, torch.zeros(1, 500, dtype=torch.long), SamplingConfig(max_new_tokens=20))
