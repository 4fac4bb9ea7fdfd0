"""init_weights(seed): the same weights for the same seed, whatever the device or layout."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from forja.models import build_model
from forja.names import canonical_name
from forja.testing import run_distributed


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_same_seed_same_weights_other_seed_other_weights(family):
    a, b = _state(build_model(family, "debug", seed=7)), _state(build_model(family, "debug", seed=7))
    c = _state(build_model(family, "debug", seed=8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_a_layer_does_not_depend_on_how_many_layers_there_are():
    small = _state(build_model("gpt2", "debug", seed=1, n_layers=2))
    large = _state(build_model("gpt2", "debug", seed=1, n_layers=4))
    # GPT-2 scales residual projections by depth; the others must be untouched.
    for key in ("layers.1.attention.wq.weight", "layers.1.feed_forward.w1.weight", "tok_embeddings.weight"):
        assert torch.equal(small[key], large[key])


def test_statistics_follow_the_rule():
    model = build_model("llama", "tiny", seed=0)
    sd = model.state_dict()
    assert torch.equal(sd["layers.3.ffn_norm.weight"], torch.ones(256))
    assert abs(sd["layers.0.attention.wq.weight"].std().item() - 0.02) < 0.002
    assert sd["layers.0.attention.wq.weight"].abs().max() <= 3 * 0.02 + 1e-6  # truncated at 3 std
    depth_std = 0.02 / (2 * 8) ** 0.5
    assert abs(sd["layers.0.feed_forward.w2.weight"].std().item() - depth_std) < 0.1 * depth_std


def test_wrapper_names_are_ignored():
    assert canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == \
        "layers.0.attention.wq.weight"


def _init_sharded(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model("llama", "debug", device="meta", tie_embeddings=False)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_fsdp_sharded_init_equals_single_process_init():
    reference = _state(build_model("llama", "debug", seed=5, tie_embeddings=False))
    for full in run_distributed(_init_sharded, 2):
        assert full.keys() == reference.keys()
        for key in reference:
            assert torch.equal(full[key], reference[key]), key
