"""Activation sizes logged at validation (forja/train/probes.py)."""

import pytest
import torch

from forja.models import build_model
from forja.train.probes import ActivationSizes


def test_sizes_are_mean_abs_of_the_last_block_and_the_logits_mup_multiplier_included():
    torch.manual_seed(0)
    model = build_model("llama", "debug", dim=64, n_heads=2, n_kv_heads=1, ffn_dim=192, mup_width_mult=4.0)
    model.init_weights(0)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    hidden = {}
    handle = model.layers["3"].register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    with ActivationSizes([model]) as sizes:
        logits = model(tokens)
    handle.remove()
    got = sizes.means()
    assert got["val_act_logits"] == pytest.approx(logits.abs().mean().item(), rel=1e-5)  # after the 1/4
    assert got["val_act_hidden"] == pytest.approx(hidden["h"].abs().mean().item(), rel=1e-5)
    model(tokens)  # the hooks are gone once the block is left
    assert sizes.means() == got
