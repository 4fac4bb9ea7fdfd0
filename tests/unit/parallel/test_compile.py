"""forja's compile step: every block, and the loss on the logits where the model makes logits."""

from __future__ import annotations

import torch

from forja.models import build_model
from forja.models.common.transformer import next_token_loss
from forja.parallel.compile import apply_compile


def _loss_and_grads(model, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_the_loss_is_compiled_on_the_logits_and_trains_as_the_eager_one():
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))  # (B, T + 1)
    eager, compiled = (build_model("llama", "debug", seed=0, vocab_size=512) for _ in range(2))
    apply_compile(compiled, backend="aot_eager")  # the same graphs as inductor's, without its C++ build
    assert compiled.token_loss is not next_token_loss and eager.token_loss is next_token_loss
    (loss, grads), (want, want_grads) = _loss_and_grads(compiled, tokens), _loss_and_grads(eager, tokens)
    torch.testing.assert_close(loss, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_a_fused_loss_or_a_tensor_parallel_one_stays_as_it_is():
    fused = build_model("llama", "debug", seed=0, vocab_size=512, fused_ops=("cross_entropy",))
    apply_compile(fused, backend="aot_eager")
    assert fused.token_loss is next_token_loss  # the fused op makes no logits to compile a loss on
    plain = build_model("llama", "debug", seed=0, vocab_size=512)
    apply_compile(plain, backend="aot_eager", loss=False)  # as forja/parallel/parallelize.py asks under TP
    assert plain.token_loss is next_token_loss
