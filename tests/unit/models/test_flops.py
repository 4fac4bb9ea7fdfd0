"""flops_per_token (6N + 12 L H hd T) against FLOPs counted by PyTorch while training."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from forja.models import build_model


def measured_flops_per_token(model, batch: int, seq_len: int) -> float:
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq_len))
    counter = FlopCounterMode(display=False)
    # The math backend runs attention as matmuls the counter sees; the CPU flash kernel
    # is not registered with FlopCounterMode and would count as zero.
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).float().logsumexp(-1).mean().backward()
    return counter.get_total_flops() / (batch * seq_len)


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
