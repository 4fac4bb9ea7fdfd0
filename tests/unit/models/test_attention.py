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


def _reference_sink_attention(q, k, v, allowed, sinks):
    """Softmax over [scores, sink] per query, written out head by head."""
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        kh = h // (q.shape[1] // k.shape[1])
        scores = q[:, h] @ k[:, kh].transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Tq, Tk)
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        sink = torch.exp(sinks[h] - scores.amax(-1, keepdim=True))
        out[:, h] = (weights / (weights.sum(-1, keepdim=True) + sink)) @ v[:, kh]
    return out


@torch.no_grad()
def test_attention_sinks_join_the_softmax_with_no_value():
    from forja.models.common.attention import attend

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    got = attend(q, k, v, build_mask(None, q_len=7, kv_len=7), sinks=sinks)
    torch.testing.assert_close(got, _reference_sink_attention(q, k, v, causal, sinks), atol=1e-6, rtol=1e-5)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    mask = build_mask(docs, q_len=7, kv_len=7, window=3)
    ref = torch.cat([_reference_sink_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask.dense[b, 0], sinks)
                     for b in range(2)])
    torch.testing.assert_close(attend(q, k, v, mask, sinks=sinks), ref, atol=1e-6, rtol=1e-5)
    # A sink at -inf takes no weight: plain attention. A large one takes almost all of it.
    plain = attend(q, k, v, build_mask(None, q_len=7, kv_len=7))
    torch.testing.assert_close(attend(q, k, v, build_mask(None, q_len=7, kv_len=7),
                                      sinks=torch.full((4,), float("-inf"))), plain)
    assert attend(q, k, v, build_mask(None, q_len=7, kv_len=7), sinks=torch.full((4,), 30.0)).abs().max() < 1e-6


@torch.no_grad()
def test_sink_model_decodes_through_the_cache_as_it_runs_whole():
    model = _model("llama", attention_sinks=True, layer_types=("sliding_attention", "full_attention"),
                   sliding_window=4, n_layers=2)
    for block in model.layers.values():
        block.attention.sinks.normal_(0, 1.0)  # init is 0: make each head's sink its own
    tokens = torch.randint(0, 2048, (2, 12))
    full = model(tokens)
    cache = model.new_kv_cache(2, 12)
    parts = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_layer_types_give_each_block_its_own_window():
    tokens = torch.randint(0, 2048, (2, 12))
    kinds = ("sliding_attention", "full_attention")
    mixed = _model("llama", n_layers=2, layer_types=kinds, sliding_window=3)(tokens)
    # No layer types and a window: every block slides (the old meaning of sliding_window).
    all_sliding = _model("llama", n_layers=2, layer_types=("sliding_attention",) * 2, sliding_window=3)(tokens)
    torch.testing.assert_close(all_sliding, _model("llama", n_layers=2, sliding_window=3)(tokens))
    # A window as long as the row changes nothing; otherwise the mix is neither extreme.
    torch.testing.assert_close(_model("llama", n_layers=2, layer_types=kinds, sliding_window=12)(tokens),
                               _model("llama", n_layers=2)(tokens))
    assert (mixed - all_sliding).abs().max() > 1e-3
    assert (mixed - _model("llama", n_layers=2)(tokens)).abs().max() > 1e-3


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(layer_types=("full_attention",)), "names 1 blocks but model.n_layers=2"),
    (dict(layer_types=("full_attention", "local")), "holds .local.; each must be one of full_attention"),
    (dict(layer_types=("full_attention", "linear_attention")),
     "linear_attention.; each must be one of full_attention, sliding_attention .this family"),
    (dict(layer_types=("full_attention", "sliding_attention")), "sliding_window is None; set the window"),
])
def test_bad_layer_types_are_named(overrides, message):
    from forja.errors import ForjaError

    with pytest.raises(ForjaError, match=message):
        _model("llama", n_layers=2, **overrides)


def _masks_seen(model) -> dict[str, list]:
    """Per block name, the AttentionMask each forward handed its attention (a public hook)."""
    seen: dict[str, list] = {name: [] for name in model.layers}
    for name, block in model.layers.items():
        block.attention.register_forward_pre_hook(lambda _, args, name=name: seen[name].append(args[2]))
    return seen


@torch.no_grad()
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_forward_builds_one_mask_per_kind_of_block_for_all_its_layers(backend):
    """Four blocks, two kinds: each forward builds two masks, every block of a kind gets the
    same object, and the next batch gets new ones (no mask outlives its documents)."""
    from forja import fallbacks

    kinds = ("sliding_attention", "full_attention") * 2
    model = _model("llama", n_layers=4, layer_types=kinds, sliding_window=3, attention=backend)
    seen = _masks_seen(model)
    tokens = torch.randint(0, 2048, (2, 12))
    batches = [torch.tensor([[0] * 5 + [1] * 7, [0] * 12]), torch.tensor([[0] * 9 + [1] * 3, [0] * 2 + [1] * 10])]
    for docs in batches:
        model(tokens, docs)
    fallbacks.clear()  # "flex" on CPU ran SDPA, and said so
    for step in range(len(batches)):
        by_kind: dict[str, list] = {}
        for name, kind in zip(model.layers, kinds):
            by_kind.setdefault(kind, []).append(seen[name][step])
        for masks in by_kind.values():
            assert all(m is masks[0] for m in masks)
        assert by_kind["sliding_attention"][0] is not by_kind["full_attention"][0]
    first, second = seen["0"]
    assert first is not second and not torch.equal(first.dense, second.dense)


@pytest.mark.parametrize("window", [None, 200])
def test_block_masks_compiled_once_take_every_batch_without_recompiling(window):
    """The compiled builder CUDA uses (here with the eager backend: what is guarded is
    dynamo's, whatever the backend) on forja's mask_mod: a new batch's documents are an
    input, not a constant baked in at the first call, and cost no recompilation."""
    from torch.nn.attention.flex_attention import create_block_mask

    from forja.models.common.attention import _block_mask_builder, _flex_block_mask, flex_mask_mod

    assert _block_mask_builder(torch.device("cpu")) is create_block_mask  # eager off CUDA
    build = torch.compile(create_block_mask, backend="eager", dynamic=False)
    T = 512  # four 128-token tiles a side
    one = torch.zeros(2, T, dtype=torch.long)
    split = torch.tensor([[0] * 256 + [1] * 256, [0] * 128 + [1] * 384])
    built = [build(flex_mask_mod(one, window), 2, None, T, T, device="cpu")]
    with torch.compiler.set_stance("fail_on_recompile"):
        built.append(build(flex_mask_mod(split, window), 2, None, T, T, device="cpu"))
    for got, docs in zip(built, (one, split)):
        want = _flex_block_mask(docs, T, window, torch.device("cpu"))
        assert torch.equal(got.to_dense(), want.to_dense())
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    assert not torch.equal(built[0].to_dense(), built[1].to_dense())  # the two batches differ
