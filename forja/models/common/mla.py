"""Multi-head latent attention (MLA): DeepSeek-V2's attention, also DeepSeek-V3's.

DeepSeek-V2 (DeepSeek-AI 2024, arXiv 2405.04434, section 2.1). Keys and values of every
head come out of one small latent per token, c_kv (kv_lora_rank wide); queries optionally
out of a latent too (q_lora_rank). Position enters through a separate, "decoupled" rotary
part: each query head has qk_rope_head_dim rotated dimensions, and all heads share one
rotated key head computed from the token directly:

    q        = wq(x)  or  wq_b(q_norm(wq_a(x)))           (B, T, H, dn + dr)
    c_kv, kr = split(wkv_a(x), [r, dr])                    latent (r) and shared key part (dr)
    k_nope, v = split(wkv_b(kv_norm(c_kv)), [dn, dv])      per head
    k        = [k_nope, rope(kr)]   q = [q_nope, rope(q_rope)]
    out      = wo(softmax(q k^T * scale) v)                 scale = 1/sqrt(dn + dr) (x YaRN's mscale^2)

Values (dv) may be narrower than keys (dn + dr): SDPA takes them as they are. The rotary
part uses forja's rotate-half layout; DeepSeek's checkpoints use interleaved pairs, which
the family's Hugging Face adapter permutes into this layout when loading (exactly: the
same products in the same order), so the forward pass pays nothing for it.

Under tensor parallelism wq / wq_b / wkv_b split the heads (column-parallel) and wo sums
them (row-parallel); wq_a, wkv_a and the latent norms stay whole on every rank. The one
rotated key head is shared by all heads, so a rank holding some heads holds part of its
gradient: it passes through `SharedKeyHead`, a module boundary where the family's plan sums
that gradient over the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache, attend
from forja.models.common.max_logit import MaxLogitTracking
from forja.models.common.norms import RMSNorm
from forja.models.common.rope import apply_rope

LATENT_NORM_EPS = 1e-6
"""Epsilon of q_norm and kv_norm: DeepSeek's reference code and Hugging Face leave these two
norms at their default whatever the model's rms_norm_eps, so forja does too."""


class LatentAttentionArgs:
    """Marks a family's args whose attention is MLA, so that planners and checks can tell it by
    type (the family's dataclass holds the fields; this adds none), and checks their widths."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def check_latent_attention(self, family: str) -> None:
        """The widths latent attention needs (head_dim derived from them when unset; a key and
        a value per query head), each refused naming the field."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim is None:
            self.head_dim = qk
        if self.head_dim != qk:
            raise ForjaError(f"model.head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                             f"{qk} in {family}; leave it unset")
        if self.n_kv_heads not in (None, self.n_heads):
            raise ForjaError(f"model.n_kv_heads={self.n_kv_heads}: latent attention has a key and value per "
                             f"query head; leave it unset (it is n_heads = {self.n_heads})")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ForjaError(f"model.{name}={getattr(self, name)} must be at least 1")


class SharedKeyHead(nn.Module):
    """The rotated key part k_rope (B, T, 1, dr), shared by every head, repeated for `heads`
    heads (a view, no copy). A module only so that a tensor-parallel plan can hook it."""

    def forward(self, k_rope: torch.Tensor, heads: int) -> torch.Tensor:
        B, T, _, dr = k_rope.shape
        return k_rope.expand(B, T, heads, dr)  # (B, T, H, dr)


class MLA(MaxLogitTracking, nn.Module):
    """Multi-head latent attention over n_heads heads; `q_lora_rank=0` projects queries
    directly (DeepSeek-V2-Lite), above 0 through a normalized latent (V2, V3)."""

    def __init__(self, dim: int, n_heads: int, *, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, softmax_scale: float, fused_rope: bool = False,
                 fused_norm: bool = False):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.softmax_scale = softmax_scale
        self.fused_rope = fused_rope
        self.q_lora = q_lora_rank > 0
        if self.q_lora:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS, fused=fused_norm)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS, fused=fused_norm)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.shared_key = SharedKeyHead()

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"mixer": "latent_attention"}

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim) -> q (B, T, H, dn + dr); H is this rank's heads under TP."""
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        return q.view(B, T, -1, self.qk_dim)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> k_nope (B, T, H, dn), v (B, T, H, dv), and the shared, not yet
        rotated key part k_rope (B, T, 1, dr)."""
        B, T, _ = x.shape
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, T, r), (B, T, dr)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, T, -1, self.nope_dim + self.v_dim)  # (B, T, H, dn + dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return k_nope, v, k_rope.view(B, T, 1, self.rope_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: AttentionMask,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); rope = cos, sin (T, dr), or None: nothing rotates (NoPE,
        Kimi Linear's MLA: the dr-wide parts stay one shared key head and its query parts)."""
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x).split([self.nope_dim, self.rope_dim], dim=-1)  # (B, T, H, dn|dr)
        k_nope, v, k_rope = self.keys_values(x)
        if rope is not None and self.fused_rope:
            from forja.ops import rope as fused_rope

            q_rope, k_rope = fused_rope(q_rope, k_rope, *rope)
        elif rope is not None:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        H = q_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, T, H, dn + dr)
        k = torch.cat((k_nope, self.shared_key(k_rope, H)), dim=-1)  # (B, T, H, dn + dr)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, ...)
        if cache is not None:
            # The cache holds keys and values expanded per head: simple, and the same cache
            # as other attention layers. MLA's saving at inference -- caching only c_kv and
            # k_rope (r + dr numbers a token instead of H (2 dn + dr + dv)) with wkv_b
            # absorbed into the query and output -- is not implemented.
            k, v = cache.update(layer, k, v)
        self.track_logits(q, k, mask, self.softmax_scale)
        out = attend(q, k, v, mask, scale=self.softmax_scale)  # (B, H, T, dv)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))
