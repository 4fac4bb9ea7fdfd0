"""forja's context parallelism, mixer by mixer, on Gloo: attention (full, sliding window,
sinks, grouped-query, documents, latent-attention widths) and the recurrent mixers (Gated
DeltaNet, Kimi Delta Attention, Mamba-2; with and without documents), each kind
(ring, all-to-all) at cp 2 and 4, against the same mixer on whole rows in one process.
Outputs and every gradient (inputs and parameters) must agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from forja.testing import run_distributed

TOL = 2e-6  # fp32, relative to the largest value compared (or absolute below 1); measured ones printed (pytest -s)
# name -> (heads, kv heads, head dim, value dim, window, sinks, documents)
ATTENTION = {
    "causal": (4, 4, 8, 8, None, False, False),
    "gqa documents": (4, 2, 8, 8, None, False, True),
    "one kv head": (4, 1, 8, 8, None, False, False),
    "window documents": (4, 2, 8, 8, 11, False, True),
    "sinks window": (4, 4, 8, 8, 9, True, False),
    "latent widths": (4, 4, 12, 8, None, False, True),
}


def _diff(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


def _documents(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) increasing document ids with a few random boundaries, one on a chunk's edge."""
    starts = torch.rand(B, T, generator=gen) < 0.08
    starts[:, T // 2] = True
    starts[:, 0] = False
    return starts.long().cumsum(1)


def _attention_case(name: str, kind: str, group, device: str) -> dict[str, float]:
    from forja.models.common.attention import attend, build_mask
    from forja.parallel.cp import ContextParallel

    H, Hkv, d, dv, window, with_sinks, with_docs = ATTENTION[name]
    B, T = 2, 48
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(B, H, T, d, generator=gen), torch.randn(B, Hkv, T, d, generator=gen)
    v, w = torch.randn(B, Hkv, T, dv, generator=gen), torch.randn(B, H, T, dv, generator=gen)
    sinks = torch.randn(H, generator=gen) if with_sinks else None
    docs = _documents(B, T, gen) if with_docs else None
    q, k, v, w = (t.to(device) for t in (q, k, v, w))
    sinks = sinks.to(device) if with_sinks else None
    docs = docs.to(device) if with_docs else None
    leaves = [t.requires_grad_() for t in (q, k, v) + ((sinks,) if with_sinks else ())]
    whole = build_mask(docs, q_len=T, kv_len=T, window=window, device=torch.device(device))
    (attend(q, k, v, whole, scale=0.3, sinks=sinks) * w).sum().backward()
    ref = [t.grad.clone() for t in leaves]
    expected = attend(q, k, v, whole, scale=0.3, sinks=sinks).detach()
    for t in leaves:
        t.grad = None
    cp = ContextParallel(group, kind)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    part = cp.split(ids, ids, docs)
    layout = part.sequence.layout
    local = [layout.take(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.detach().clone().requires_grad_() if with_sinks else None
    mask = part.sequence.mask("sliding_attention" if window else "full_attention", window=window, backend="sdpa",
                              flex_causal=with_sinks)
    out = attend(*local, mask, scale=0.3, sinks=local_sinks)
    (out * layout.take(w, dim=2)).sum().backward()
    errors = {"out": _diff(out, layout.take(expected, dim=2))}
    for label, mine, theirs in zip("qkv", local, ref):
        errors[f"d{label}"] = _diff(mine.grad, layout.take(theirs, dim=2))
    if with_sinks:
        torch.distributed.all_reduce(local_sinks.grad, group=group)  # each rank's queries' share
        errors["dsinks"] = _diff(local_sinks.grad, ref[3])
    return errors


# Each recurrent mixer, small: name -> a builder (called under torch.manual_seed(0)). Kimi Delta
# Attention's decay is per key channel; under all-to-all at cp 4 each of Mamba-2's 2 groups goes to 2 ranks.
def _gated_deltanet(dim: int):
    from forja.models.common.gated_deltanet import GatedDeltaNet

    return GatedDeltaNet(dim, n_k_heads=4, n_v_heads=8, head_k_dim=4, head_v_dim=4, chunk_size=8)


def _kimi_delta(dim: int):
    from forja.models.common.kimi_delta_attention import KimiDeltaAttention

    return KimiDeltaAttention(dim, n_heads=4, head_dim=4, chunk_size=8)


def _mamba2(dim: int):
    from forja.models.common.mamba2 import Mamba2

    mixer = Mamba2(dim, n_heads=4, head_dim=4, n_groups=2, state_size=4, chunk_size=8)
    with torch.no_grad():
        mixer.dt_bias.uniform_(-2.0, 0.0)  # shorter time steps: more of the state crosses each segment
    return mixer


RECURRENT = {"gated deltanet": _gated_deltanet, "kimi delta": _kimi_delta, "mamba2": _mamba2}


def _recurrent_case(name: str, kind: str, group, documents: bool, device: str) -> dict[str, float]:
    from forja.models.common.attention import AttentionMask
    from forja.parallel.cp import ContextParallel

    B, T, dim = 2, 48, 16
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    mixer = RECURRENT[name](dim)
    with torch.no_grad():
        mixer.A_log.uniform_(-1.0, 1.0)
    x, w = torch.randn(B, T, dim, generator=gen), torch.randn(B, T, dim, generator=gen)
    docs = _documents(B, T, gen) if documents else None
    if documents:  # the second row: one document over several segments (the state carried through whole
        # ones), then a start inside a segment and one just before a segment (its halo half another document's)
        docs[1] = (torch.arange(T) >= 27).long() + (torch.arange(T) >= 35).long()
        docs = docs.to(device)
    mixer, x, w = mixer.to(device), x.to(device).requires_grad_(), w.to(device)
    expected = mixer(x, None, AttentionMask(document_ids=docs))
    (expected * w).sum().backward()
    ref_x, ref_params = x.grad.clone(), {n: p.grad.clone() for n, p in mixer.named_parameters()}
    mixer.zero_grad()
    cp = ContextParallel(group, kind)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    part = cp.split(ids, ids, docs)
    layout = part.sequence.layout
    local_x = layout.take(x.detach()).requires_grad_()
    out = mixer(local_x, None, part.sequence.mask("linear_attention", window=None, backend="sdpa", flex_causal=False))
    (out * layout.take(w)).sum().backward()
    errors = {"out": _diff(out, layout.take(expected.detach())), "dx": _diff(local_x.grad, layout.take(ref_x))}
    for n, p in mixer.named_parameters():  # each rank's tokens' share of the gradient
        torch.distributed.all_reduce(p.grad, group=group)
        errors[f"d{n}"] = _diff(p.grad, ref_params[n])
    return errors


def _all_cases(rank: int, world: int, device: str = "cpu") -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    from forja.parallel.cp import ring

    results = {}
    whole_blocks = ring.TILE_SCORES
    for kind in ("ring", "all-to-all"):
        for name in ATTENTION:
            if kind == "all-to-all" and ATTENTION[name][1] % world and world % ATTENTION[name][1]:
                continue
            # with documents, the ring's blocks go a few query rows at a time (their masks sliced)
            ring.TILE_SCORES = 200 if "documents" in name else whole_blocks
            results[f"{kind} {name}"] = _attention_case(name, kind, group, device)
        ring.TILE_SCORES = whole_blocks
        for mixer in RECURRENT:
            for documents in (False, True):
                results[f"{kind} {mixer}{' documents' if documents else ''}"] = _recurrent_case(
                    mixer, kind, group, documents, device)
    return results


# cp 1: a ring of one (the one-GPU case of tests/gpu/test_context_parallel.py) still merges a chunk and its mirror
@pytest.fixture(scope="module", params=[1, 2, 4], ids=["cp1", "cp2", "cp4"])
def measured(request):
    return request.param, run_distributed(_all_cases, request.param, timeout_s=120)


def test_every_mixer_matches_whole_rows(measured):
    world, by_rank = measured
    worst = {case: max(max(r[case].values()) for r in by_rank) for case in by_rank[0]}
    for case, err in worst.items():
        what = max(by_rank[0][case], key=by_rank[0][case].get)
        print(f"cp {world} {case}: max relative diff = {err:.1e} ({what})")
    assert len(worst) == 2 * (len(ATTENTION) + 2 * len(RECURRENT))
    bad = {case: err for case, err in worst.items() if not err < TOL}
    assert not bad, bad
