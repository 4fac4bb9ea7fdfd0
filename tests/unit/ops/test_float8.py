"""float8 training through torchao, emulated on CPU."""

import pytest
import torch
from torch import nn

from forja.models import build_model
from forja.ops.float8 import apply_float8

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_model_trains_close_to_fp32(recipe):
    reference = build_model("llama", "debug", seed=0, tie_embeddings=False)
    model = build_model("llama", "debug", seed=0, tie_embeddings=False, device="meta")
    swapped = apply_float8(model, recipe, device=torch.device("cpu"), min_features=0)
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert swapped == 4 * 7  # every block projection; the output projection stays
    assert isinstance(model.layers["0"].feed_forward.w2, Float8Linear) and type(model.output) is nn.Linear
    assert list(model.state_dict()) == list(reference.state_dict())  # same names: same checkpoints
    tokens, labels = torch.randint(0, 2048, (2, 32)), torch.randint(0, 2048, (2, 32))
    losses = []
    for m in (reference, model):
        loss = m(tokens, labels=labels)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], abs=2e-2)  # float8 rounding, not another model
    g_ref = reference.layers["1"].attention.wq.weight.grad
    g8 = model.layers["1"].attention.wq.weight.grad
    assert torch.nn.functional.cosine_similarity(g8.flatten(), g_ref.flatten(), dim=0) > 0.99


def test_small_layers_are_skipped():
    # debug Llama: wq/wo 128x128, wk/wv 128->64 (2 kv heads of 32), w1/w3 128->384, w2 384->128.
    def swapped(min_features):
        model = build_model("llama", "debug", device="meta")
        return apply_float8(model, "tensorwise", device=torch.device("cpu"), min_features=min_features)

    assert swapped(128) == 4 * 5  # wk and wv have 64 output features: too small
    assert swapped(129) == 0
