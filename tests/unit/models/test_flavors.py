"""Flavors by name: the small ones' sizes, overrides, unknown names. Every family's published
sizes are checked against transformers in test_conformance.py."""

import pytest

from forja.errors import ForjaError
from forja.models import build_model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_small_flavors_are_the_advertised_size(family):
    assert 0.8e6 < build_model(family, "debug", device="meta").num_params() < 1.3e6
    assert 8e6 < build_model(family, "tiny", device="meta").num_params() < 12e6


def test_overrides_and_bad_names():
    model = build_model("llama", "debug", device="meta", n_layers=2, vocab_size=100, qk_norm=True)
    assert len(model.layers) == 2 and model.args.vocab_size == 100
    assert model.layers["0"].attention.q_norm is not None
    with pytest.raises(ForjaError, match="unknown model family 'mistral'"):
        build_model("mistral", "debug")
    with pytest.raises(ForjaError, match="unknown llama flavor '3-8b'; known flavors: debug, tiny"):
        build_model("llama", "3-8b")
    with pytest.raises(ForjaError, match="llama has no model field 'n_layer'"):
        build_model("llama", "debug", n_layer=3)
    with pytest.raises(ForjaError, match="model.n_heads=4 is not a multiple of model.n_kv_heads=3"):
        build_model("llama", "debug", n_kv_heads=3)
