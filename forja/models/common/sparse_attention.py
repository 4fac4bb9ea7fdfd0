"""DeepSeek Sparse Attention (DSA): a lightning indexer picks, for each query, the `index_topk`
keys latent attention (forja/models/common/mla.py) then attends to; DeepSeek-V3.2's and GLM-5's.

DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models" (2025,
arXiv 2512.02556), section 2.1. The indexer is a small multi-head scorer with ReLU instead of
softmax and one key head shared by its heads:

    q_I   = wq_b(c_q)                         (B, T, H_I, d_I)   c_q: MLA's normalized query latent
    k_I   = LayerNorm(wk(x))                  (B, T, d_I)        one key per token
    w     = weights_proj(x) / sqrt(H_I)       (B, T, H_I)        per-head weights of each query
    I[t,s] = sum_h w[t,h] * ReLU(q_I[t,h] . k_I[s] / sqrt(d_I))  (B, T, T)

Rotary positions turn the first `rope_dim` dimensions of q_I and k_I (the rest pass), in
forja's half-split pairs (DeepSeek-V3.2) or in interleaved pairs (GLM-5), which are computed
here by de-interleaving the rotated part first: the same products, so the scores are the
same. The published inference code also applies a Hadamard transform to q_I and k_I before
quantizing them to FP8; it is orthogonal (Hq . Hk = q . k) and transformers skips it along with
the FP8 quantization, so forja does too: the scores are those transformers computes, in fp32.

Each query keeps the top-k keys by I among the keys it may see (causal, within its packed
document: a key outside the query's document scores -inf and is never chosen); when fewer than
`index_topk` keys exist (early positions) it keeps them all. Attention over the selected keys
equals attention over all keys under a mask true exactly at them: the top-k indices are
scattered into a (B, 1, T, T) boolean mask and forja's attention path (SDPA; memory-efficient on
CUDA) runs dense under it, as transformers does. Its memory is then a masked dense attention's
(the mask, the kernel's output and log-sum-exp), not a gathered copy of every query's keys and
values (B, H, T, k, d: hundreds of GB a layer at T 4096, k 2048); its FLOPs are dense too,
4 H (dk + dv) T a token forward over all T keys, masked ones included: no fused sparse kernel
(FlashMLA's) skips them. The indexer's scores are accumulated over chunks of its heads
(`INDEXER_HEAD_CHUNK`), so that only (B, T, chunk, T) per-head scores live at once.

Training the indexer (section 2.1.1), `dsa_stage`:
- None: the indexer selects and nothing trains it (transformers' forward; inference).
- "dense_warmup": attention stays dense; the indexer learns to match the main attention's
  distribution, summed over heads and L1-normalized, p[t, :], by KL(p || softmax(I[t, :])),
  with the attention detached and the indexer's inputs detached: its loss reaches only the
  indexer (the paper freezes every other parameter in this stage: leave them out of training).
- "sparse": attention over the selected keys; the indexer's loss is the same KL restricted to
  the selected keys S_t, KL(p[t, S_t] || softmax(I[t, S_t])), its inputs detached from the main
  model, which trains through the language-modelling loss alone.
In both the target p is computed apart from the attention's output (which SDPA returns without
its probabilities), without gradients, a chunk of heads at a time: one more q k^T forward.
The KL, averaged over the block's tokens and times `indexer_loss_weight`, joins the step's loss
as the mixture of experts' auxiliary losses do (`AddAuxLoss`, scaled by the step context's share).

Under context parallelism (forja/parallel/cp) a rank holds part of each row, and the forward's
mask carries the `SequenceMixing` that sees the whole rows. The indexer needs no more than a
rank's own queries and every earlier key, and its keys are narrow (one of d_I a token, shared
by its heads): the rank gathers the whole rows' indexer keys (`gather_rows`; their gradients go
home), scores its own queries against them and keeps their top-k, as one process would for
those queries. The sequence object then runs the attention over the whole rows under that
selection (`attend_selected`: all-to-all gathers the selection of the whole rows for this
rank's heads, ring masks each block with it) and, for the indexer's target, returns this rank's
queries' probabilities summed over every head (all-to-all sums the ranks' heads; ring takes the
keys round once more against the merged log-sum-exp). The KL is then the mean over this rank's
queries, which the ranks' average of gradients makes the mean over the rows: both stages are
the same numbers as in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache, attend
from forja.models.common.mla import MLA
from forja.models.common.rope import apply_rope
from forja.models.common.step_context import OUTSIDE_A_STEP, AddAuxLoss

DSA_STAGES = (None, "dense_warmup", "sparse")
INDEXER_NORM_EPS = 1e-6
"""Epsilon of the indexer's key LayerNorm, fixed in DeepSeek's code and transformers'."""
INDEXER_HEAD_CHUNK = 8
"""Indexer heads (and, for the indexer's training target, attention heads) whose per-head
scores (B, T, chunk, T) are computed at once: 512 MiB in fp32 at T 4096 instead of 4 GiB for
DeepSeek-V3.2's 64 indexer heads (forja/plan/activations.py `indexer_saved` prices it)."""


def check_dsa_fields(n_heads: int, head_dim: int, topk: int, rope_dim: int, stage, weight: float) -> None:
    """Refuses indexer fields no DSA model has, naming the field."""
    if n_heads < 1 or topk < 1 or head_dim < rope_dim:
        raise ForjaError(f"model.index_n_heads={n_heads} and index_topk={topk} must be at least 1 and "
                         f"index_head_dim={head_dim} at least qk_rope_head_dim={rope_dim}")
    if stage not in DSA_STAGES:
        raise ForjaError(f"model.dsa_stage={stage!r} is not one of {DSA_STAGES}")
    if weight < 0:
        raise ForjaError(f"model.indexer_loss_weight={weight} must be at least 0")


def allowed_keys(mask: AttentionMask, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(B or 1, Tq, Tk) bool: the keys each query may see, from a forward's mask (the queries are
    the last Tq of Tk positions)."""
    if mask.block_mask is not None:
        raise ForjaError("DeepSeek Sparse Attention reads dense masks only: set model.attention = \"sdpa\"")
    if mask.dense is not None:
        return mask.dense[:, 0].to(device)
    if mask.is_causal:
        q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        return (q_pos >= torch.arange(k_len, device=device)[None, :])[None]
    return torch.ones(1, q_len, k_len, dtype=torch.bool, device=device)


class LightningIndexer(nn.Module):
    """Scores every (query, key) pair of a layer (module docstring); parameters named as
    transformers' `indexer.*`: wq_b, wk, k_norm (a LayerNorm with bias), weights_proj."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, *,
                 interleaved: bool = False):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.interleaved = n_heads, head_dim, rope_dim, interleaved
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the leading rope_dim dims of x (B, T, heads, d_I); interleaved pairs come out
        de-interleaved (evens then odds), as transformers' interleaved rotation writes them."""
        r = self.rope_dim
        x_rot, x_pass = x.split([r, x.shape[-1] - r], dim=-1)
        if self.interleaved:
            x_rot = torch.cat((x_rot[..., 0::2], x_rot[..., 1::2]), dim=-1)
        return torch.cat((apply_rope(x_rot, *rope), x_pass), dim=-1)

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (B, T, dim) -> the rotated keys k_I (B, T, d_I)."""
        return self.rotate(self.k_norm(self.wk(x)).unsqueeze(2), rope).squeeze(2)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                keys: torch.Tensor) -> torch.Tensor:
        """x (B, Tq, dim), the query latent (B, Tq, q_lora_rank), keys (B, Tk, d_I) -> the index
        scores I (B, Tq, Tk), fp32, unmasked."""
        B, T, _ = x.shape
        q = self.rotate(self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim), rope)  # (B, Tq, H_I, d_I)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5  # (B, Tq, H_I)
        keys_t = keys.float().transpose(-1, -2).unsqueeze(1)  # (B, 1, d_I, Tk)
        total = None
        for h in range(0, self.n_heads, INDEXER_HEAD_CHUNK):  # a chunk of heads at a time: (B, Tq, c, Tk) live
            part = F.relu(torch.matmul(q[:, :, h:h + INDEXER_HEAD_CHUNK].float(), keys_t) * self.head_dim**-0.5)
            part = torch.matmul(w[:, :, None, h:h + INDEXER_HEAD_CHUNK], part).squeeze(-2)  # (B, Tq, Tk)
            total = part if total is None else total + part
        return total


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    """The softmax's dtype: fp32 for half-precision scores, else theirs (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def head_summed_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention's probabilities summed over heads, fp32, without gradients (the indexer's
    training target): q (B, H, Tq, dk), k (B, H, Tk, dk), allowed (B or 1, Tq, Tk) -> (B, Tq, Tk).
    A chunk of heads at a time, so that (B, chunk, Tq, Tk) scores live at once."""
    total = None
    with torch.no_grad():
        for h in range(0, q.shape[1], INDEXER_HEAD_CHUNK):
            part = torch.matmul(q[:, h:h + INDEXER_HEAD_CHUNK], k[:, h:h + INDEXER_HEAD_CHUNK].transpose(-1, -2))
            part = (part * scale).masked_fill(~allowed[:, None], float("-inf"))  # (B, c, Tq, Tk)
            part = part.softmax(-1, dtype=_at_least_fp32(q)).float().sum(1)
            total = part if total is None else total + part
    return total


class WholeRows:
    """The rows all here (no context parallelism): what `SparseMLA` asks of a `SequenceMixing`
    (forja/models/common/attention.py) for rows split over ranks, done in one process. `mask` is
    the forward's, for `q_len` queries after `k_len - q_len` cached positions."""

    def __init__(self, mask: AttentionMask, q_len: int, k_len: int):
        self.mask, self.q_len, self.k_len = mask, q_len, k_len

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def visible_keys(self, device: torch.device) -> torch.Tensor:
        return allowed_keys(self.mask, self.q_len, self.k_len, device)

    def attend_selected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                        selected: bool, scale: float, probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = attend(q, k, v, AttentionMask(dense=keep[:, None]) if selected else self.mask, scale=scale)
        return out, head_summed_probs(q, k, keep, scale) if probs else None


def indexer_kl(p: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(scores)) averaged over queries: p (B, Tq, n) the main attention's
    probabilities summed over heads (detached), scores (B, Tq, n) the indexer's, valid (B, Tq, n)
    the keys both range over. The target is p over the valid keys, L1-normalized."""
    p = p.detach().float().masked_fill(~valid, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    log_q = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)
    kl = p * (torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) - log_q)  # 0 where p is 0
    return kl.sum(-1).mean()


class SparseMLA(MLA):
    """Latent attention whose queries each attend to the `topk` keys its lightning indexer
    selects (module docstring); `stage` and `loss_weight` train the indexer."""

    def __init__(self, dim: int, n_heads: int, *, index_n_heads: int, index_head_dim: int, index_topk: int,
                 index_interleaved: bool = False, stage: str | None = None, loss_weight: float = 1.0, **mla):
        super().__init__(dim, n_heads, **mla)
        if not self.q_lora:
            raise ForjaError("model.q_lora_rank=0: the lightning indexer reads MLA's query latent; set q_lora_rank")
        self.indexer = LightningIndexer(dim, self.wq_a.out_features, index_n_heads, index_head_dim, self.rope_dim,
                                        interleaved=index_interleaved)
        self.topk, self.stage, self.loss_weight = index_topk, stage, loss_weight
        if stage is None:  # selection runs without gradients: frozen, so no optimizer holds state it never steps
            self.indexer.requires_grad_(False)
        self.step_context = OUTSIDE_A_STEP  # the step engine's: this micro-batch's share of the loss
        self.last_indexer_loss: torch.Tensor | None = None  # the latest training forward's KL (detached)

    def structure_fields(self) -> dict:
        return {"mixer": "latent_attention", "indexer": (self.indexer.n_heads, self.indexer.head_dim, self.topk,
                                                         DSA_STAGES.index(self.stage))}

    def _indexer_keys(self, x, rope, cache: KVCache | None, layer: int) -> torch.Tensor:
        """This forward's indexer keys after those cached (B, Tk, d_I); the cache keeps them in its
        per-layer mixer state, a (B, max_len, d_I) buffer."""
        keys = self.indexer.keys(x, rope)  # (B, T, d_I)
        if cache is None:
            return keys
        if layer not in cache.mixer_states:
            cache.mixer_states[layer] = keys.new_zeros(keys.shape[0], cache.max_len, keys.shape[-1])
        held, end = cache.mixer_states[layer], cache.length + keys.shape[1]
        held[:, cache.length:end] = keys
        return held[:, :end]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); rope = cos, sin (T, dr)."""
        B, T, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))  # (B, T, q_lora_rank)
        q_nope, q_rope = self.wq_b(q_latent).view(B, T, -1, self.qk_dim).split([self.nope_dim, self.rope_dim], -1)
        k_nope, v, k_rope = self.keys_values(x)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        H = q_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # (B, H, T, dn + dr)
        k = torch.cat((k_nope, self.shared_key(k_rope, H)), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, H, Tk, ...)
        # Under context parallelism the rows are split: `rows` scores against and attends over
        # the whole rows' keys (T of them) for this rank's queries.
        rows = mask.sequence or WholeRows(mask, T, k.shape[2])
        train_indexer = self.stage is not None and self.training and torch.is_grad_enabled()
        with torch.set_grad_enabled(train_indexer):  # transformers' indexer runs without gradients
            x_in, latent_in = (x.detach(), q_latent.detach()) if train_indexer else (x, q_latent)
            keys = rows.gather_rows(self._indexer_keys(x_in, rope, cache, layer))  # (B, Tk, d_I) whole rows
            scores = self.indexer(x_in, latent_in, rope, keys)  # (B, T, Tk) fp32
        allowed = rows.visible_keys(x.device)  # (B or 1, T, Tk)
        self.track_logits(q, k, mask, self.softmax_scale)
        selected = self.stage != "dense_warmup" and keys.shape[1] > self.topk  # else every key it may see
        keep = self.selected(scores, allowed) if selected else allowed  # (B or 1, T, Tk)
        out, p = rows.attend_selected(q, k, v, keep, selected=selected, scale=self.softmax_scale,
                                      probs=train_indexer)  # (B, H, T, dv), (B, T, Tk) or None
        aux = None
        if not train_indexer:
            del scores, keep, allowed  # no longer needed: let the (B, T, Tk) tensors go before wo
        else:
            keep = keep.expand_as(scores)
            aux = indexer_kl(p, scores, keep)
        out = self.wo(out.transpose(1, 2).reshape(B, T, -1))
        if aux is not None:
            self.last_indexer_loss = aux.detach()
            out = AddAuxLoss.apply(out, self.loss_weight * aux, self.step_context.aux_loss_share)
        return out

    def selected(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """(B, T, Tk) bool, True at each query's top-k keys by index score among those it may see
        (`allowed` (B or 1, T, Tk)); all of them where fewer exist."""
        with torch.no_grad():
            ranked = scores.detach().masked_fill(~allowed, float("-inf"))
            idx = ranked.topk(min(self.topk, scores.shape[-1]), dim=-1).indices  # (B, T, k)
            del ranked
            keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)
        return keep & allowed  # early rows: the -inf keys topk also returned are not theirs to see
