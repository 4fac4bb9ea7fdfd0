"""Document masking, grouped-query attention and the KV cache."""

import pytest
import torch

from forja.models import build_model
from forja.models.common.attention import build_mask


def _model(family, **kw):
    return build_model(family, "debug", seed=0, **kw).eval()


@torch.no_grad()
def test_packed_documents_do_not_see_each_other():
    # Llama's rotary positions are relative, so a document gives the same logits alone
    # (positions from 0) and packed after another (positions shifted).
    model = _model("llama")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 2048, (1, 7), generator=gen), torch.randint(0, 2048, (1, 13), generator=gen)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 7 + [1] * 13])
    out = model(packed, doc_ids)
    torch.testing.assert_close(out[:, :7], model(a), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, 7:], model(b), atol=1e-5, rtol=0)
    # Without the document ids, the second document does see the first.
    assert (model(packed)[:, 7:] - model(b)).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_document_equals_plain_causal(family):
    model = _model(family)
    tokens = torch.randint(0, 2048, (2, 24))
    torch.testing.assert_close(model(tokens, torch.zeros(2, 24, dtype=torch.long)), model(tokens))


def test_mask_kinds():
    same = torch.zeros(2, 8, dtype=torch.long)
    assert build_mask(same, q_len=8, kv_len=8).is_causal
    two = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    m = build_mask(two, q_len=8, kv_len=8)
    assert not m.is_causal and m.dense.shape == (2, 1, 8, 8)
    assert m.dense[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert build_mask(None, q_len=1, kv_len=9).dense is None  # one decoded token sees all the cache


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_cache_matches_full_forward(family):
    model = _model(family)
    tokens = torch.randint(0, 2048, (2, 20))
    full = model(tokens)
    cache = model.new_kv_cache(2, 20)
    parts = [model(tokens[:, :8], cache=cache)]  # prefill
    parts += [model(tokens[:, 8:11], cache=cache)]  # a chunk after the cache
    parts += [model(tokens[:, t:t + 1], cache=cache) for t in range(11, 20)]  # one at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_grouped_query_attention_equals_repeated_heads():
    # A GQA model equals the multi-head model whose k/v heads are the GQA heads repeated.
    gqa = _model("llama", n_heads=4, n_kv_heads=2)
    mha = _model("llama", n_heads=4, n_kv_heads=4)
    state = gqa.state_dict()
    hd = gqa.args.head_dim
    for key, value in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = value.view(2, hd, -1)  # (Hkv, hd, dim)
            state[key] = heads.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 2048, (2, 16))
    torch.testing.assert_close(mha(tokens), gqa(tokens), atol=1e-5, rtol=1e-5)


def test_sliding_window_mask():
    m = build_mask(None, q_len=6, kv_len=6, window=3)
    assert m.dense[0, 0, 5].tolist() == [False, False, False, True, True, True]
    docs = torch.tensor([[0, 0, 0, 0, 1, 1]])
    m = build_mask(docs, q_len=6, kv_len=6, window=3)
    assert m.dense[0, 0, 3].tolist() == [False, True, True, True, False, False]
    assert m.dense[0, 0, 5].tolist() == [False, False, False, False, True, True]  # window and document


@torch.no_grad()
def test_sliding_window_model_with_cache_matches_full_forward():
    model = _model("llama", sliding_window=5)
    tokens = torch.randint(0, 2048, (2, 14))
    full = model(tokens)
    cache = model.new_kv_cache(2, 14)
    parts = [model(tokens[:, :6], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    # A window as long as the sequence changes nothing; a short one does.
    torch.testing.assert_close(_model("llama", sliding_window=14)(tokens), _model("llama")(tokens))
    assert (full - _model("llama")(tokens)).abs().max() > 1e-3


@torch.no_grad()
def test_loss_from_labels_equals_cross_entropy_of_logits():
    model = _model("gpt2")
    tokens, labels = torch.randint(0, 2048, (2, 12)), torch.randint(0, 2048, (2, 12))
    expected = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(model(tokens, labels=labels), expected)
