"""flops_per_token (6N + 12 L H hd T) against FLOPs counted by PyTorch while training."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from forja.models import FAMILIES, build_model, model_args


@register_flop_formula([torch.ops.aten.linalg_solve_triangular])
def _triangular_solve_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A (n, n) triangular system with m right-hand sides: n^2 m FLOPs per batch entry
    (Gated DeltaNet's chunked form solves two per chunk; the counter knows no formula)."""
    return math.prod(b_shape[:-2]) * a_shape[-1] ** 2 * b_shape[-1]


def measured_flops_per_token(model, batch: int, seq_len: int) -> float:
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq_len))
    counter = FlopCounterMode(display=False)
    # The math backend runs attention as matmuls the counter sees; the CPU flash kernel
    # is not registered with FlopCounterMode and would count as zero.
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).float().logsumexp(-1).mean().backward()
    counts = counter.get_flop_counts()["Global"]
    total = sum(counts.values())
    # torch's counter sizes a grouped convolution's backward as a dense one (Gated DeltaNet's
    # depthwise convolutions: ~100x their forward); count it as the usual 2x the forward.
    conv_backward = torch.ops.aten.convolution_backward
    if conv_backward in counts:
        total += 2 * counts[torch.ops.aten.convolution] - counts[conv_backward]
    return total / (batch * seq_len)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("seq_len", [64, 512])
def test_formula_within_5_percent_of_counted(family, seq_len):
    model = build_model(family, "debug")
    measured = measured_flops_per_token(model, 2, seq_len)
    formula = model.flops_per_token(seq_len)
    print(f"{family} T={seq_len}: formula/measured = {formula / measured:.4f}")
    assert abs(formula / measured - 1) < 0.05


def test_untied_embedding_lookup_is_not_counted():
    tied = build_model("llama", "debug", device="meta", tie_embeddings=True)
    untied = build_model("llama", "debug", device="meta", tie_embeddings=False)
    table = untied.args.vocab_size * untied.args.dim
    assert untied.num_params() - tied.num_params() == table
    assert untied.flops_per_token(128) == tied.flops_per_token(128)  # the lookup is no matmul


def test_mixture_of_experts_counts_the_active_experts_only():
    # Every token-slot runs exactly one expert, so the counted FLOPs are those of the
    # parameters a token uses: top_k of n_experts experts (the loop's F.linear is counted).
    model = build_model("qwen3", "debug-moe", moe_impl="loop")
    measured = measured_flops_per_token(model, 2, 64)
    formula = model.flops_per_token(64)
    print(f"qwen3 debug-moe: formula/measured = {formula / measured:.4f}")
    assert abs(formula / measured - 1) < 0.05
    assert model.num_active_params() < 0.7 * model.num_params()


def test_sliding_blocks_count_the_keys_they_see():
    full = build_model("llama", "debug", n_layers=2)
    mixed = build_model("llama", "debug", n_layers=2, layer_types=("sliding_attention", "full_attention"),
                        sliding_window=64)
    a = full.args
    per_block = 12 * a.n_heads * a.head_dim
    assert full.flops_per_token(512) - mixed.flops_per_token(512) == per_block * (512 - 64)
    assert full.flops_per_token(32) == mixed.flops_per_token(32)  # shorter than the window
    measured = measured_flops_per_token(mixed, 1, 256)
    print(f"sliding 64 of 256: formula/measured = {mixed.flops_per_token(256) / measured:.4f}")
    # The dense mask still multiplies the full square: the count says what a windowed kernel does.
    assert mixed.flops_per_token(256) < measured


@pytest.mark.parametrize("seq_len", [64, 256])
def test_linear_attention_blocks_count_their_chunked_delta_rule(seq_len):
    """Qwen3.5's debug flavor: three Gated DeltaNet blocks to one of attention."""
    model = build_model("qwen3_5", "debug")
    ratio = model.flops_per_token(seq_len) / measured_flops_per_token(model, 1, seq_len)
    print(f"qwen3_5 T={seq_len}: formula/measured = {ratio:.4f}")
    assert abs(ratio - 1) < 0.05
    # The mixing cost of a Gated DeltaNet block stops growing past one chunk; attention's does not.
    linear = [model.mixer_flops("linear_attention", t) for t in (64, 4096)]
    full = [model.mixer_flops("full_attention", t) for t in (64, 4096)]
    assert linear[0] == linear[1] and full[1] == 64 * full[0]


def _counted_shape(family: str) -> tuple[dict, int]:
    """Overrides and a length at which torch's counter sees what the formula counts: experts
    run as a loop of F.linear (the counter knows no grouped matmul) and no block's window is
    shorter than the sequence (a dense mask multiplies the full square)."""
    args = model_args(family, "debug")
    overrides = {"moe_impl": "loop"} if getattr(args, "n_experts", 0) else {}
    return overrides, min(64, getattr(args, "sliding_window", None) or 64)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_formula_within_5_percent_of_counted(card, family):
    """The planner's FLOPs (flops_per_token) against torch's flop counter, the debug flavor."""
    overrides, seq_len = _counted_shape(family)
    model = build_model(family, "debug", **overrides)
    ratio = model.flops_per_token(seq_len) / measured_flops_per_token(model, 2, seq_len)
    print(f"{family} debug T={seq_len}: formula/measured = {ratio:.4f}")
    card(family, "flops", round(ratio, 4))
    assert abs(ratio - 1) < 0.05
