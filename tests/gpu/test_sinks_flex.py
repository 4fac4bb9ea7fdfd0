"""Attention sinks under FlexAttention (their log-sum-exp rescaling the output) equal the
scores written out (the SDPA backend's path), forward and backward, with sliding windows
and packed documents, in gpt-oss's mix of sliding and full blocks (CUDA)."""

import pytest
import torch

from forja.models import build_model


@pytest.mark.parametrize("documents", [True, False])
def test_flex_sinks_match_the_written_out_scores(documents):
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0] * 100 + [1] * 156, [0] * 40 + [1] * 60 + [2] * 156], device="cuda")
    tokens = torch.randint(0, 2048, (2, 256), device="cuda")
    logits, grads = [], []
    for backend in ("sdpa", "flex"):
        model = build_model("gpt_oss", "debug", seed=0, device="cuda", attention=backend)
        with torch.no_grad():  # sinks that differ by head and matter
            for i, block in enumerate(model.layers.values()):
                block.attention.sinks.copy_(torch.linspace(-2.0, 2.0, block.attention.sinks.numel()) * (i + 1))
        out = model(tokens, doc_ids if documents else None)
        out.float().logsumexp(-1).mean().backward()
        logits.append(out.detach())
        grads.append(torch.cat([model.layers["0"].attention.sinks.grad,
                                model.layers["1"].attention.wq.weight.grad.flatten()]))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-5, rtol=1e-3)


def test_generation_with_sinks_and_windows_runs_through_the_cache():
    """Decoding past the window with the cache equals the whole forward (SDPA after prefill)."""
    model = build_model("gpt_oss", "debug", seed=0, device="cuda", attention="flex").eval()
    tokens = torch.randint(0, 2048, (1, 40), device="cuda")
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(1, 40)
        parts = [model(tokens[:, :10], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(10, 40)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-4, rtol=1e-4)
