"""DeepSeek Sparse Attention under forja's context parallelism, on Gloo at cp 2: the mixer
(forja/models/common/sparse_attention.py `SparseMLA`, its lightning indexer choosing 6 of up to
32 keys) on a rank's part of each row against the same mixer on whole rows in one process, for
both kinds (ring, all-to-all), with and without packed documents, untrained and in both of the
indexer's training stages. Outputs, the input's and every parameter's gradient (the indexer's
KL loss included) and the KL itself must agree to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from forja.testing import run_distributed

TOL = 2e-6  # fp32, relative to the largest value compared (or absolute below 1); measured ones printed (pytest -s)
B, T, DIM = 2, 32, 32
STAGES = (None, "sparse", "dense_warmup")


def _diff(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


def _mixer():
    """A small SparseMLA with every parameter drawn (under torch.manual_seed(0) by the caller)."""
    from forja.models.common.sparse_attention import SparseMLA

    mixer = SparseMLA(DIM, 4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, softmax_scale=0.3, index_n_heads=4, index_head_dim=16, index_topk=6,
                      stage="sparse")  # every parameter trainable; the case sets its stage
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            else:  # norms' weights near 1, the indexer key norm's bias near 0
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.1)
    return mixer.train()


def _rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from forja.models.common.rope import rope_cos_sin, rope_frequencies

    return rope_cos_sin(rope_frequencies(8, 10_000.0), positions)


def _documents() -> torch.Tensor:
    """(B, T): the first row three documents (one starting on the all-to-all chunks' edge), the
    second two (one starting inside a ring chunk)."""
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[0, 11:] += 1
    docs[0, T // 2:] += 1
    docs[1, 21:] = 1
    return docs


def _case(kind: str, stage: str | None, documents: bool, group) -> dict[str, float]:
    import torch.distributed as dist

    from forja.models.common.attention import build_mask
    from forja.models.common.step_context import StepContext
    from forja.parallel.cp import ContextParallel

    torch.manual_seed(0)
    mixer = _mixer()
    mixer.stage = stage
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(B, T, DIM, generator=gen), torch.randn(B, T, DIM, generator=gen)
    docs = _documents() if documents else None
    x.requires_grad_()
    whole = build_mask(docs, q_len=T, kv_len=T, device=torch.device("cpu"))
    expected = mixer(x, _rope(torch.arange(T)), whole)
    (expected * w).sum().backward()
    ref_x = x.grad.clone()
    ref = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    ref_kl = mixer.last_indexer_loss
    assert any(n.startswith("indexer.") for n in ref) == (stage is not None)  # the KL's gradients compared too
    mixer.zero_grad(set_to_none=True)

    cp = ContextParallel(group, kind)
    ids = torch.zeros(B, T, dtype=torch.long)
    part = cp.split(ids, ids, docs)
    layout = part.sequence.layout
    # Each rank's KL is the mean over its queries: the ranks' gradients, added up, then hold
    # 1/cp of each, which is the whole rows' mean (the engine averages them over cp).
    mixer.step_context = StepContext(aux_loss_share=1.0 / cp.cp)
    local_x = layout.take(x.detach()).requires_grad_()
    mask = part.sequence.mask("full_attention", window=None, backend="sdpa", flex_causal=False)
    out = mixer(local_x, _rope(layout.positions()), mask)
    (out * layout.take(w)).sum().backward()
    errors = {"out": _diff(out, layout.take(expected.detach())), "dx": _diff(local_x.grad, layout.take(ref_x))}
    assert {n for n, p in mixer.named_parameters() if p.grad is not None} == set(ref)
    for n, p in mixer.named_parameters():
        if p.grad is not None:  # each rank's tokens' share of the gradient
            dist.all_reduce(p.grad, group=group)
            errors[f"d{n}"] = _diff(p.grad, ref[n])
    if stage is not None:
        kl = mixer.last_indexer_loss.clone()
        dist.all_reduce(kl, group=group)
        errors["kl"] = _diff(kl / cp.cp, ref_kl)
    return errors


def _all_cases(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    from forja.parallel.cp import ring

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    whole_blocks, results = ring.TILE_SCORES, {}
    for kind in ("ring", "all-to-all"):
        for documents in (False, True):
            # with documents, the ring's blocks go a few query rows at a time (their selections sliced)
            ring.TILE_SCORES = 100 if documents and kind == "ring" else whole_blocks
            for stage in STAGES:
                results[f"{kind} {stage}{' documents' if documents else ''}"] = _case(kind, stage, documents, group)
    ring.TILE_SCORES = whole_blocks
    return results


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_all_cases, 2, timeout_s=120)


def test_sparse_attention_matches_whole_rows(measured):
    worst = {case: max(max(r[case].values()) for r in measured) for case in measured[0]}
    for case, err in worst.items():
        what = max(measured[0][case], key=measured[0][case].get)
        print(f"cp 2 {case}: max relative diff = {err:.1e} ({what})")
    assert len(worst) == 2 * 2 * len(STAGES)
    bad = {case: err for case, err in worst.items() if not err < TOL}
    assert not bad, bad


def test_the_cases_select():
    """The cases' rows are longer than the top-k and their selection changes the output: a CP
    run that attended to every key it may see would fail the comparison above."""
    from forja.models.common.attention import build_mask

    torch.manual_seed(0)
    mixer = _mixer()
    x = torch.randn(B, T, DIM, generator=torch.Generator().manual_seed(5))
    rope, mask = _rope(torch.arange(T)), build_mask(None, q_len=T, kv_len=T)
    with torch.no_grad():
        sparse = mixer(x, rope, mask)
        mixer.stage = "dense_warmup"
        dense = mixer(x, rope, mask)
    assert (sparse - dense).abs().max() > 1e-2
