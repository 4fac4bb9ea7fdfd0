"""DeepSeek-V4's compressed attention under context parallelism (forja/parallel/cp/compressed.py),
on Gloo: each kind of block (sliding, HCA, CSA with its indexer) under each kind of layout
(ring, all-to-all) at cp 2 and 4, against the same module on whole rows in one process.
Chunks of 6 or 12 tokens against windows of 11 and compression ratios of 4 and 8: windows that
straddle chunks, and a sliding window reaching back over several chunks (cp 4, ring).
Outputs and every gradient (input and parameters) must agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from forja.testing import run_distributed

TOL = 2e-6  # fp32, relative to the largest value compared (or absolute below 1); measured ones printed (pytest -s)
KINDS = ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention")
RATIO = {"heavily_compressed_attention": 8, "compressed_sparse_attention": 4}
B, T, DIM, WINDOW = 2, 48, 32, 11


def _diff(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


def _module(kind: str):
    from forja.models.common.compressed_attention import CompressedAttention
    from forja.models.common.rope import rope_frequencies

    inv_freq = rope_frequencies(8, 10_000.0)
    torch.manual_seed(0)
    mixer = CompressedAttention(DIM, 4, 16, kind=kind, q_lora_rank=16, o_groups=2, o_lora_rank=8, inv_freq=inv_freq,
                                ratio=RATIO.get(kind, 0), index_n_heads=2, index_head_dim=8, index_topk=3)
    with torch.no_grad():  # random everywhere (norm gains near 1): picks and gates that differ by position
        for name, p in mixer.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if name.endswith("norm.weight") else 0.3 * torch.randn(p.shape))
    return mixer, inv_freq


def _case(kind: str, layout_kind: str, group) -> dict[str, float]:
    from forja.models.common.attention import AttentionMask
    from forja.models.common.kv_compressor import half_rope_tables
    from forja.parallel.cp import ContextParallel

    mixer, inv_freq = _module(kind)
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(B, T, DIM, generator=gen).requires_grad_(), torch.randn(B, T, DIM, generator=gen)
    pos = torch.arange(T)
    q, k = pos[:, None], pos[None, :]
    whole = AttentionMask(dense=((q >= k) & (q - k < WINDOW))[None, None], positions=pos)
    expected = mixer(x, half_rope_tables(inv_freq, pos), whole)
    (expected * w).sum().backward()
    ref_x, ref_params = x.grad.clone(), {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    assert set(ref_params) == {n for n, p in mixer.named_parameters() if p.requires_grad}  # all but the indexer
    mixer.zero_grad()
    part = ContextParallel(group, layout_kind).split(pos[None].expand(B, -1), pos[None].expand(B, -1), None)
    layout = part.sequence.layout
    mask = part.sequence.mask("compressed_attention", window=WINDOW, backend="sdpa", flex_causal=False)
    mask.positions = part.positions
    local_x = layout.take(x.detach()).requires_grad_()
    out = mixer(local_x, half_rope_tables(inv_freq, part.positions), mask)
    (out * layout.take(w)).sum().backward()
    errors = {"out": _diff(out, layout.take(expected.detach())), "dx": _diff(local_x.grad, layout.take(ref_x))}
    for n, ref in ref_params.items():  # each rank's tokens' share of the gradient
        grad = mixer.get_parameter(n).grad
        torch.distributed.all_reduce(grad, group=group)
        errors[f"d{n}"] = _diff(grad, ref)
    return errors


def _all_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    return {f"{layout} {kind}": _case(kind, layout, group) for layout in ("ring", "all-to-all") for kind in KINDS}


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_compressed_attention_matches_whole_rows(world):
    by_rank = run_distributed(_all_cases, world, timeout_s=120)
    worst = {case: max(max(r[case].values()) for r in by_rank) for case in by_rank[0]}
    for case, err in worst.items():
        what = max(by_rank[0][case], key=by_rank[0][case].get)
        print(f"cp {world} {case}: max relative diff = {err:.1e} ({what})")
    assert len(worst) == 2 * len(KINDS)
    bad = {case: err for case, err in worst.items() if not err < TOL}
    assert not bad, bad
