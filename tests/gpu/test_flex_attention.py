"""FlexAttention's block masks equal SDPA's dense masks, forward and backward (CUDA)."""

import pytest
import torch

from forja.models import build_model


@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("documents", [True, False])
def test_flex_masks_match_sdpa(window, documents):
    if not documents and window is None:
        pytest.skip("plain causal runs SDPA with is_causal on both backends")
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 100 + [1] * 156, [0] * 40 + [1] * 60 + [2] * 156], device="cuda")
    tokens = torch.randint(0, 2048, (2, 256), device="cuda")
    grads, logits = [], []
    for backend in ("sdpa", "flex"):
        model = build_model("llama", "debug", seed=0, device="cuda", attention=backend, sliding_window=window)
        out = model(tokens, doc_ids if documents else None)
        out.float().logsumexp(-1).mean().backward()
        logits.append(out.detach())
        grads.append(model.layers["0"].attention.wq.weight.grad)
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-5, rtol=1e-3)


def test_a_forward_builds_one_block_mask_compiled_for_every_layer():
    """Four flex blocks of two kinds: one BlockMask per kind per forward, built by the
    compiled create_block_mask, equal to the eager one; the next batch's documents cost no
    recompilation of the builder."""
    from torch.nn.attention.flex_attention import create_block_mask

    from forja.models.common.attention import _block_mask_builder, _flex_block_mask, flex_mask_mod

    kinds = ("sliding_attention", "full_attention") * 2
    model = build_model("llama", "debug", seed=0, device="cuda", attention="flex", n_layers=4, layer_types=kinds,
                        sliding_window=48)
    seen = {}
    for name, block in model.layers.items():
        block.attention.register_forward_pre_hook(lambda _, args, name=name: seen.setdefault(name, args[2].block_mask))
    doc_ids = torch.tensor([[0] * 100 + [1] * 156, [0] * 40 + [1] * 60 + [2] * 156], device="cuda")
    with torch.no_grad():
        model(torch.randint(0, 2048, (2, 256), device="cuda"), doc_ids)
    assert seen["0"] is seen["2"] and seen["1"] is seen["3"] and seen["0"] is not seen["1"]
    assert _block_mask_builder(doc_ids.device) is not create_block_mask  # the compiled one
    for window, mask in ((48, seen["0"]), (None, seen["1"])):
        eager = create_block_mask(flex_mask_mod(doc_ids, window), 2, None, 256, 256, device="cuda")
        assert torch.equal(mask.to_dense(), eager.to_dense())
        assert torch.equal(mask.full_kv_num_blocks, eager.full_kv_num_blocks)
    other = torch.tensor([[0] * 200 + [1] * 56, [0] * 256], device="cuda")
    with torch.compiler.set_stance("fail_on_recompile"):
        again = _flex_block_mask(other, 256, None, doc_ids.device)
    eager = create_block_mask(flex_mask_mod(other, None), 2, None, 256, 256, device="cuda")
    assert torch.equal(again.to_dense(), eager.to_dense())
