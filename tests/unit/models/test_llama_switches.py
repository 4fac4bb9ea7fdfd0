"""The speedrun switches of forja's Llama (LlamaArgs): a squared-ReLU feed-forward, a soft cap
on the logits, zero-initialized projections, U-net skips; each checked against the model
without it, and refused where it cannot go (transformers' Llama, tensor and pipeline parallelism)."""

import math

import pytest
import torch

from forja.errors import ForjaError
from forja.models import build_model, model_args
from forja.models.llama.hf import config_from_args
from forja.models.llama.model import llama_tp_plan
from forja.parallel.checks import LayoutRequest, check_layout
from forja.parallel.config import ParallelConfig

TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


def _model(**overrides):
    return build_model("llama", "debug", seed=3, **overrides)


def test_relu2_at_one_and_a_half_widths_holds_swiglus_parameters_and_trains():
    swiglu, relu2 = _model(), _model(ffn_activation="relu2", ffn_dim=384 * 3 // 2)
    assert relu2.num_params() == swiglu.num_params()
    assert relu2.layers["0"].structure.ffn == "relu2"
    loss = relu2(TOKENS, labels=TOKENS.roll(-1, 1))
    loss.backward()
    assert relu2.layers["0"].feed_forward.w1.weight.grad.abs().sum() > 0
    assert "feed_forward.w3" not in llama_tp_plan(relu2.args, True).block
    assert "feed_forward.w3" in llama_tp_plan(swiglu.args, True).block


def test_the_soft_cap_bounds_the_logits_as_cap_tanh_of_the_plain_ones():
    plain, capped = _model(), _model(logit_softcap=2.0)
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        raw, out = plain(TOKENS), capped(TOKENS)
    assert out.abs().max() < 2.0
    torch.testing.assert_close(out, 2.0 * torch.tanh(raw / 2.0), rtol=0, atol=1e-6)
    with pytest.raises(ForjaError, match="logit_softcap is set, but the fused cross-entropy"):
        model_args("llama", "debug", logit_softcap=15.0, fused_ops=("cross_entropy",))


def test_zero_initialized_projections_start_every_block_as_the_identity():
    model = _model(zero_init_projections=True, tie_embeddings=False)
    for name in ("layers.0.attention.wo.weight", "layers.3.feed_forward.w2.weight", "output.weight"):
        assert model.get_parameter(name).abs().max() == 0, name
    assert model.get_parameter("layers.0.attention.wq.weight").std() > 0.01  # the rest as before
    with torch.no_grad():
        loss = model(TOKENS, labels=TOKENS.roll(-1, 1))
    assert loss.item() == pytest.approx(math.log(2048), abs=1e-5)  # zero logits: uniform
    tied = _model(zero_init_projections=True)  # the output is the embedding: drawn as one
    assert tied.output.weight is tied.tok_embeddings.weight and tied.output.weight.std() > 0.01


def test_unet_skips_with_zero_weights_are_the_plain_model_and_otherwise_join_the_halves():
    plain, skips = _model(), _model(unet_skips=True)
    assert skips.skip_weights.shape == (2,) and torch.equal(skips.skip_weights, torch.ones(2))
    state = {**plain.state_dict(), "skip_weights": torch.zeros(2)}
    skips.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(skips(TOKENS), plain(TOKENS), rtol=0, atol=0)
        skips.skip_weights.fill_(1.0)
        assert (skips(TOKENS) - plain(TOKENS)).abs().max() > 1e-3
    skips(TOKENS, labels=TOKENS.roll(-1, 1)).backward()
    assert skips.skip_weights.grad.abs().min() > 0  # both skips are used


def test_unet_skips_by_hand_on_an_odd_depth():
    """Five blocks: block 4 receives block 0's output, block 3 block 1's, block 2 none."""
    model = build_model("llama", "debug", seed=1, n_layers=5, unet_skips=True)
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.5, -2.0]))
        h = model.tok_embeddings(TOKENS)
        rope = model.rope_tables(torch.arange(TOKENS.shape[1]))
        mask = model.mask_for("full_attention", None, TOKENS.shape[1], 0, TOKENS.device)
        outs = []
        for i in range(5):
            if i == 3:
                h = h - 2.0 * outs[1]
            if i == 4:
                h = h + 0.5 * outs[0]
            h = model.layers[str(i)](h, rope, mask, None, i)
            outs.append(h)
        torch.testing.assert_close(model(TOKENS), model.logits(model.norm(h)), rtol=0, atol=0)


@pytest.mark.parametrize("switch", [dict(ffn_activation="relu2"), dict(logit_softcap=30.0), dict(unet_skips=True)])
def test_transformers_has_no_such_llama_and_the_export_says_so(switch):
    name = next(iter(switch))
    with pytest.raises(ForjaError, match=f"a Llama with {name} has no LlamaForCausalLM equivalent"):
        config_from_args(model_args("llama", "debug", **switch))
    config_from_args(model_args("llama", "debug", zero_init_projections=True))  # an init: exports as Llama


@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_unet_skips_are_refused_on_tensor_and_pipeline_parallelism(axis):
    request = LayoutRequest(args=model_args("llama", "debug", unet_skips=True), parallel=ParallelConfig(**{axis: 2}),
                            world_size=2, seq_len=64, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ForjaError, match=rf"parallel.{axis} = 2 .* U-net skips \(model.unet_skips\)"):
        check_layout(request)
