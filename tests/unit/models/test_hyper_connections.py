"""Manifold-constrained hyper-connections (forja/models/common/hyper_connections.py) against
transformers' DeepSeek-V4 modules on random weights: the mixing weights, the collapsed
sublayer input, the merged streams and the final head."""

from __future__ import annotations

import torch

from forja.models.common.hyper_connections import HyperConnection, HyperHead, sinkhorn
from tests.unit.models.deepseek_v4_reference import randomize, tiny_config


def test_hyper_connection_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    config = tiny_config()
    ref = DeepseekV4HyperConnection(config)
    randomize(ref, seed=1)
    ours = HyperConnection(config.hidden_size, config.hc_mult, sinkhorn_iters=config.hc_sinkhorn_iters,
                           eps=config.hc_eps, norm_eps=config.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    streams = torch.randn(2, 5, config.hc_mult, config.hidden_size)  # (B, T, n, D)
    post, comb, collapsed = ours(streams)
    r_post, r_comb, r_collapsed = ref(streams)
    for a, b in ((post, r_post), (comb, r_comb), (collapsed, r_collapsed)):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-6
    out = torch.randn(2, 5, config.hidden_size)
    expected = r_post.unsqueeze(-1) * out.unsqueeze(-2) + r_comb.transpose(-1, -2) @ streams
    assert (HyperConnection.merge(streams, out, post, comb) - expected).abs().max() < 1e-6


def test_sinkhorn_is_nearly_doubly_stochastic():
    m = sinkhorn(torch.rand(7, 4, 4) + 0.1, iters=30, eps=1e-9)
    assert (m.sum(-1) - 1).abs().max() < 1e-4 and (m.sum(-2) - 1).abs().max() < 1e-6


def test_hyper_head_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    config = tiny_config()
    ref = DeepseekV4HyperHead(config)
    randomize(ref, seed=2)
    ours = HyperHead(config.hidden_size, config.hc_mult, eps=config.hc_eps, norm_eps=config.rms_norm_eps)
    ours.load_state_dict({k.removeprefix("hc_"): v for k, v in ref.state_dict().items()})
    streams = torch.randn(2, 5, config.hc_mult, config.hidden_size)
    assert (ours(streams) - ref(streams)).abs().max() < 1e-6
