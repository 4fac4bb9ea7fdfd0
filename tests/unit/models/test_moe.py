"""The mixture-of-experts layer against a per-token reference written from its definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forja.errors import ForjaError
from forja.models.common.moe import MoE, MoEArgs, load_balancing_loss, router_z_loss
from forja.models.common.step_context import StepContext


def _layer(seed: int = 0, dim: int = 16, **kw) -> MoE:
    args = MoEArgs(**{"n_experts": 8, "top_k": 2, "moe_ffn_dim": 12, **kw})
    torch.manual_seed(seed)
    moe = MoE(dim, args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if moe.router.expert_bias is not None:
            moe.router.expert_bias.normal_(0, 0.1)
    return moe


def _reference(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j w_j * expert_j(x) (+ shared) token by token; `keep` (N, k) masks dropped slots."""
    flat = x.reshape(-1, x.shape[-1])
    route = moe.router(flat)
    e = moe.experts
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for j in range(moe.args.top_k):
            if keep is not None and not keep[n, j]:
                continue
            i = int(route.experts[n, j])
            h = F.silu(flat[n] @ e.w1[i].T) * (flat[n] @ e.w3[i].T)
            out[n] += route.weights[n, j] * (h @ e.w2[i].T)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("kw", [
    dict(),  # softmax, normalized top-k (Qwen3-MoE)
    dict(norm_topk_prob=False, moe_impl="loop"),
    dict(score_func="sigmoid", expert_bias=True, n_expert_groups=4, topk_groups=2, route_scale=2.5,
         n_shared_experts=1),  # DeepSeek-V3
    dict(score_func="softmax", n_expert_groups=2, topk_groups=1, group_score="max"),  # DeepSeek-V2
])
def test_moe_matches_per_token_reference(kw):
    moe = _layer(**kw)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)


def test_group_limited_routing_picks_within_best_groups():
    moe = _layer(score_func="sigmoid", n_expert_groups=4, topk_groups=1)
    route = moe.router(torch.randn(40, 16))
    groups = route.experts // 2  # 8 experts in 4 groups of 2
    assert (groups == groups[:, :1]).all()  # both choices in the one allowed group


def test_capacity_drops_the_lowest_weighted_slots():
    moe = _layer(capacity_factor=0.5, moe_impl="loop")
    x = torch.randn(1, 16, 16)
    out = moe(x)
    route = moe.router(x.reshape(-1, 16))
    capacity = int(0.5 * 16 * 2 / 8)
    keep = torch.zeros_like(route.experts, dtype=torch.bool)
    for i in range(8):
        slots = (route.experts == i).nonzero()
        best = route.weights[slots[:, 0], slots[:, 1]].argsort(descending=True, stable=True)[:capacity]
        keep[slots[best, 0], slots[best, 1]] = True
    torch.testing.assert_close(out, _reference(moe, x, keep), atol=1e-5, rtol=1e-5)
    stats = moe.take_stats()
    assert stats.dropped == int((~keep).sum()) > 0
    assert stats.tokens_per_expert.sum() == 32


def test_aux_losses_reach_the_gradients_as_if_added_to_the_loss():
    x = torch.randn(2, 6, 16)
    moe = _layer(aux_loss_weight=0.1, z_loss_weight=0.01)
    moe.step_context = StepContext(aux_loss_share=0.5)
    moe(x).square().sum().backward()
    attached = moe.router.gate.weight.grad.clone()

    plain = _layer(aux_loss_weight=0.0, z_loss_weight=0.0)
    out = plain(x)
    route = plain.router(x.reshape(-1, 16))
    aux = 0.1 * load_balancing_loss(route, 8) + 0.01 * router_z_loss(route.logits)
    (out.square().sum() + 0.5 * aux).backward()
    torch.testing.assert_close(attached, plain.router.gate.weight.grad, atol=1e-5, rtol=1e-5)
    assert moe.take_stats().aux_loss > 0


def test_a_compiled_layer_takes_each_steps_share_without_recompiling():
    """The step context's share is a tensor the compiled graph reads: a new value each step (fp16's
    scale halving and doubling) is neither a recompile nor a stale constant."""
    x = torch.randn(2, 6, 16)
    moe = _layer(aux_loss_weight=0.1, z_loss_weight=0.01)
    context = StepContext.for_engine(torch.device("cpu"), track_max_logit=False)
    moe.step_context = context
    compiled = torch.compile(moe, backend="aot_eager")

    def gate_grad(run, share: float) -> torch.Tensor:
        moe.zero_grad()
        context.begin_step(share)
        run(x).square().sum().backward()
        moe.take_stats()  # a fresh step's statistics, as the engine's hooks leave them
        return moe.router.gate.weight.grad.clone()

    gate_grad(compiled, 0.5)  # compiles
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled_grads = [gate_grad(compiled, share) for share in (0.25, 1024.0, 1 / 3)]
    for share, got in zip((0.25, 1024.0, 1 / 3), compiled_grads):
        torch.testing.assert_close(got, gate_grad(moe, share), atol=1e-5, rtol=1e-5)  # eager, same share


def test_balanced_routing_gives_an_aux_loss_of_one():
    from forja.models.common.moe import Routing

    experts = torch.arange(8).view(4, 2)  # every expert once
    route = Routing(weights=torch.full((4, 2), 0.5), experts=experts, logits=torch.zeros(4, 8),
                    probs=torch.full((4, 8), 1 / 8))
    assert float(load_balancing_loss(route, 8)) == pytest.approx(1.0)


def test_bias_update_moves_toward_underloaded_experts():
    moe = _layer(score_func="sigmoid", expert_bias=True, bias_update_rate=0.01)
    moe.router.init_buffers()
    moe.router.update_bias(torch.tensor([10.0, 0, 2, 4, 4, 4, 4, 4]))
    assert moe.router.expert_bias[0] == pytest.approx(-0.01)
    assert moe.router.expert_bias[1] == pytest.approx(0.01)
    assert moe.router.expert_bias[3] == 0


@pytest.mark.parametrize("kw, field", [
    (dict(top_k=9), "top_k"),
    (dict(n_expert_groups=3), "n_expert_groups"),
    (dict(bias_update_rate=0.1), "bias_update_rate"),
    (dict(score_func="relu"), "score_func"),
    (dict(shared_ffn_dim=48), "shared_ffn_dim"),  # a shared width with no shared expert
])
def test_bad_routing_options_name_the_field(kw, field):
    with pytest.raises(ForjaError, match=field):
        _layer(**kw)


def _took_grouped(out: torch.Tensor) -> bool:
    """Whether the experts' last matmul was torch._grouped_mm (its output passes through
    grouped_mm's contiguous-gradient identity) rather than the loop's concatenation."""
    return type(out.grad_fn).__name__ == "_ContiguousGradBackward"


@pytest.mark.parametrize("impl", ["auto", "grouped", "loop"])
def test_experts_under_bf16_autocast_take_the_grouped_path_and_match_the_loop(impl):
    from forja.ops.grouped_mm import grouped_supported

    moe = _layer(dim=16, moe_impl=impl)  # fp32 parameters, as under the default GPU precision
    counts = torch.tensor([2, 0, 3, 1, 0, 4, 2, 4])
    x = torch.randn(int(counts.sum()), 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe.experts(x, counts)
        supported = grouped_supported(x, moe.experts.w1, torch.bfloat16)
        moe.experts.impl = "loop"
        want = moe.experts(x, counts)
    assert out.dtype == torch.bfloat16
    assert _took_grouped(out) == (impl != "loop" and supported)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("parallel", "seq_len", "message"), [
    (dict(tp=2, ep=4), 64, None),  # 8 experts over ep 4 x tp 2 = 8 ranks: accepted
    (dict(tp=4, ep=4), 64, r"model n_experts = 8 \(parallel.ep x parallel.tp = 16, the ranks sharing"),
    (dict(tp=2, sequence_parallel=False), 63, r"train.seq_len = 63 \(parallel.tp = 2, whose ranks split each"),
])
def test_moe_under_tp_needs_experts_and_sequence_to_split(parallel, seq_len, message):
    import re

    from forja.models import model_args
    from forja.parallel.checks import LayoutRequest, layout_errors
    from forja.parallel.config import ParallelConfig

    r = LayoutRequest(args=model_args("qwen3", "debug-moe"), parallel=ParallelConfig(**parallel), world_size=16,
                      seq_len=seq_len, global_batch_size=16, micro_batch_size=1)
    found = [e for e in layout_errors(r) if "mixture-of-experts" in e or "ep x parallel.tp" in e]
    if message is None:
        assert found == []
    else:
        assert len(found) == 1 and re.search(message, found[0])


def test_a_shared_expert_of_any_width():
    """Qwen's shared_expert_intermediate_size need not be a whole number of experts wide."""
    moe = _layer(n_shared_experts=1, shared_ffn_dim=20)
    assert moe.shared_experts.w1.weight.shape == (20, 16)
    assert _layer(n_shared_experts=2).shared_experts.w1.weight.shape == (24, 16)  # 2 x moe_ffn_dim
