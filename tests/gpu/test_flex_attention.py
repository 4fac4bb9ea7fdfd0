"""FlexAttention's document block mask equals SDPA's dense mask, forward and backward (CUDA)."""

import torch

from forja.models import build_model


def test_flex_document_mask_matches_sdpa_dense_mask():
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 100 + [1] * 156, [0] * 40 + [1] * 60 + [2] * 156], device="cuda")
    tokens = torch.randint(0, 2048, (2, 256), device="cuda")
    grads, logits = [], []
    for backend in ("sdpa", "flex"):
        model = build_model("llama", "debug", seed=0, device="cuda", attention=backend)
        out = model(tokens, doc_ids)
        out.float().logsumexp(-1).mean().backward()
        logits.append(out.detach())
        grads.append(model.layers["0"].attention.wq.weight.grad)
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-5, rtol=1e-3)
