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
