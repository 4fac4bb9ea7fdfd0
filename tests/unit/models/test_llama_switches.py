"""The speedrun switches of forja's Llama (LlamaArgs): a squared-ReLU feed-forward, a soft cap
on the logits, zero-initialized projections, U-net skips, value embeddings; each checked against
the model without it, and refused where it cannot go (transformers' Llama, tensor and pipeline parallelism)."""

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


def test_value_embeddings_by_hand_and_the_plain_model_when_their_mix_is_off():
    """Two tables over four blocks: blocks 0 and 2 read table 0, blocks 1 and 3 table 1, each as
    v = l0 wv(x) + l1 table(tokens); l = (1, 0) is the plain model."""
    plain, model = _model(), _model(value_embeddings=2)
    assert [model.args.value_table(i) for i in range(4)] == [0, 1, 0, 1]
    assert model.num_params() == plain.num_params() + 2 * 2048 * 64 + 4 * 2
    assert model.num_params(exclude_embeddings=True) == plain.num_params(exclude_embeddings=True) + 4 * 2
    model.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        for i in range(4):
            model.layers[str(i)].attention.value_lambdas.copy_(torch.tensor([1.0, 0.0]))
        torch.testing.assert_close(model(TOKENS), plain(TOKENS), rtol=0, atol=0)
        model.layers["2"].attention.value_lambdas.copy_(torch.tensor([0.5, 2.0]))
        attention = plain.layers["2"].attention
        wv = attention.wv.weight.clone()
        # block 2's values by hand: 0.5 v + 2 table_0(tokens), through a plain model's weights
        table = model.value_embeds[0].weight  # (vocab, Hkv * hd)
        h = plain.tok_embeddings(TOKENS)
        rope = plain.rope_tables(torch.arange(TOKENS.shape[1]))
        mask = plain.mask_for("full_attention", None, TOKENS.shape[1], 0, TOKENS.device)
        for i in range(4):
            block = plain.layers[str(i)]
            if i == 2:
                x = block.attention_norm(h)
                attention.wv.weight.copy_(0.5 * wv)
                shift = 2.0 * table[TOKENS]  # (B, T, Hkv * hd): added to every value, as a bias per token
                attention.wv.register_forward_hook(lambda m, inp, out: out + shift)
                h = h + attention(x, rope, mask)
                h = h + block.feed_forward(block.ffn_norm(h))
            else:
                h = block(h, rope, mask, None, i)
        torch.testing.assert_close(model(TOKENS), plain.logits(plain.norm(h)), rtol=1e-6, atol=1e-5)
    model(TOKENS, labels=TOKENS.roll(-1, 1)).backward()
    assert model.value_embeds[0].weight.grad.abs().sum() > 0  # block 2 mixes it in
    assert model.value_embeds[1].weight.grad.abs().sum() == 0  # its blocks' l1 is 0
    assert model.layers["3"].attention.value_lambdas.grad.abs().min() > 0  # l1 learns from 0


def test_value_embeddings_decode_through_the_cache_as_the_whole_forward():
    from forja.generate import SamplingConfig, generate

    model = _model(value_embeddings=2, unet_skips=True)  # both switches in one run_blocks
    cfg = SamplingConfig(max_new_tokens=6)
    cached = generate(model, TOKENS[:, :8], cfg)
    assert torch.equal(cached, generate(model, TOKENS[:, :8], cfg, use_cache=False))


def test_value_embeddings_go_to_adamw_under_muon_and_fit_half_the_depth():
    from forja.optim.config import OptimConfig
    from forja.optim.params import muon_split

    split = muon_split(_model(value_embeddings=1), OptimConfig(name="muon"))
    assert "value_embeds.0.weight" in split["adamw"] and "layers.0.attention.wv.weight" in split["muon"]
    with pytest.raises(ForjaError, match=r"model.value_embeddings=3 must be between 0 and n_layers // 2 = 2"):
        model_args("llama", "debug", value_embeddings=3)


@pytest.mark.parametrize("switch", [dict(ffn_activation="relu2"), dict(logit_softcap=30.0), dict(unet_skips=True),
                                    dict(value_embeddings=1)])
def test_transformers_has_no_such_llama_and_the_export_says_so(switch):
    name = next(iter(switch))
    with pytest.raises(ForjaError, match=f"a Llama with {name} has no LlamaForCausalLM equivalent"):
        config_from_args(model_args("llama", "debug", **switch))
    config_from_args(model_args("llama", "debug", zero_init_projections=True))  # an init: exports as Llama


@pytest.mark.parametrize("axis", ["tp", "pp"])
@pytest.mark.parametrize(("switch", "named"), [(dict(unet_skips=True), r"U-net skips \(model.unet_skips\)"),
                                               (dict(value_embeddings=1),
                                                r"value embeddings \(model.value_embeddings\)")])
def test_skips_and_value_embeddings_are_refused_on_tensor_and_pipeline_parallelism(axis, switch, named):
    request = LayoutRequest(args=model_args("llama", "debug", **switch), parallel=ParallelConfig(**{axis: 2}),
                            world_size=2, seq_len=64, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ForjaError, match=rf"parallel.{axis} = 2 .* {named}"):
        check_layout(request)
