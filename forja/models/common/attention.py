"""Causal self-attention with grouped-query heads, document masking and a KV cache.

A packed training sequence holds several documents back to back; `document_ids`
(B, T) says which document each token belongs to, and a token attends only to earlier
tokens of its own document. The mask is built once per forward pass (`build_mask`)
and shared by every layer:

- no document ids, or one document per row: SDPA with `is_causal` (no mask tensor);
- several documents (or a sliding window), backend "sdpa": SDPA with an explicit boolean
  (B, 1, T, T) mask;
- backend "flex" on CUDA: FlexAttention with a block mask, which skips fully masked
  tiles; create_block_mask is compiled once per process (`_block_mask_builder`).
  FlexAttention has no CPU backward, so on CPU "flex" falls back to SDPA (recorded in
  forja's fallback record: one line at start, and run.json).

Under context parallelism a forward's tokens are one rank's part of each row. The model
stays single-device: the mask of each kind of block then carries a `SequenceMixing` (made
by forja/parallel/cp from a `SequenceShards` handed to the model's forward), and a mixer
asks it for whatever needs the other ranks' parts (`attend`, the recurrent mixers' scans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from forja import fallbacks
from forja.eager import before_compile
from forja.models.common.max_logit import MaxLogitTracking
from forja.models.common.norms import RMSNorm
from forja.models.common.precision import at_least_fp32
from forja.models.common.rope import apply_rope

ATTENTION_BACKENDS = ("sdpa", "flex")
FLEX_DEVICES = ("cuda",)  # where FlexAttention has a backward (a rehearsal adds its fake CPU)


@dataclass
class AttentionMask:
    """Which keys each query may see in one forward pass."""

    is_causal: bool = False
    dense: torch.Tensor | None = None  # (B, 1, Tq, Tk) bool, True = may attend
    block_mask: Any = None  # torch.nn.attention.flex_attention.BlockMask
    document_ids: torch.Tensor | None = None
    """(B, T) the documents of a packed row, for sequence mixers that carry a state (linear
    attention resets it where a document starts); None: one document per row."""
    sequence: SequenceMixing | None = None
    """Context parallelism's mixing for this kind of block: the rows are split over ranks and
    this object sees the whole (forja/parallel/cp); None: the whole rows are here."""
    positions: torch.Tensor | None = None
    """(Tq,) the queries' places in their rows, for a mixer that depends on them beyond RoPE
    (Llama 4's attention temperature); None where the family's blocks ask for none."""
    windows: dict[int, Any] | None = None
    """Packed rows' documents laid out for key/value compressors, by ratio (DeepSeek-V4:
    kv_compressor.py `DocumentWindows`), made once a forward for every block; None: none."""


class SequenceMixing(Protocol):
    """What a block's sequence mixer asks for when its rows are split over ranks."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """`attend` over the whole rows: q (B, H, Tl, hd), k (B, Hkv, Tl, hd), v (B, Hkv, Tl, hv)
        of this rank's Tl tokens -> (B, H, Tl, hv)."""

    def gated_delta(self, mixer: nn.Module, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """A delta-rule mixer's convolutions and rule over the whole rows, from this rank's
        projections (forja/models/common/gated_deltanet.py `DeltaRuleMixer.mix`: Gated DeltaNet,
        Kimi Delta Attention) -> (B, Tl, Hv, dv)."""

    def mamba2(self, mixer: nn.Module, x_in: torch.Tensor, B_in: torch.Tensor, C_in: torch.Tensor,
               dt: torch.Tensor) -> torch.Tensor:
        """A Mamba-2's convolutions, scan and skip over the whole rows, from this rank's
        projections and time steps (forja/models/common/mamba2.py `Mamba2.mix`) -> (B, Tl, H, P)."""

    def compressed_attention(self, mixer: nn.Module, x: torch.Tensor, q_latent: torch.Tensor, q: torch.Tensor,
                             kv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                             positions: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4's attention (forja/models/common/compressed_attention.py) for this rank's
        queries over the whole rows' window keys and compressed entries, from its x (B, Tl, dim),
        q_latent, q (B, H, Tl, hd), kv (B, 1, Tl, hd) and positions (Tl,) -> (B, H, Tl, hd)."""

    # What DeepSeek Sparse Attention (forja/models/common/sparse_attention.py) asks: its indexer
    # scores this rank's queries against the whole rows' keys and selects among them.
    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, Tl, ...) of this rank's tokens -> (B, T, ...) the whole rows in order; each
        rank's use of a token sends its gradient back to the token's rank."""

    def visible_keys(self, device: torch.device) -> torch.Tensor:
        """(B or 1, Tl, T) bool: the whole rows' keys each of this rank's queries may see."""

    def attend_selected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                        selected: bool, scale: float, probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attend` (shapes as there) over the keys `keep` (B or 1, Tl, T) lets each query see;
        `selected` False when keep is `visible_keys` (the layer's own mask then runs as built).
        With `probs`, also the attention's probabilities summed over every head (B, Tl, T),
        fp32, without gradients."""


class SequenceShards(Protocol):
    """A forward's rows split over ranks (context parallelism): it makes each kind of
    block's mask, one per forward, holding that kind's `SequenceMixing`."""

    def mask(self, kind: str, *, window: int | None, backend: str, flex_causal: bool) -> AttentionMask:
        """The mask of blocks of `kind` (a layer type, or "compressed_attention": every
        DeepSeek-V4 block), with `window` for sliding ones."""

    def within_chunks(self, chunk: int) -> SequenceShards:
        """The same rows with every `chunk` positions of a document a document of their own:
        chunked local attention (Llama 4) is causal attention within those."""


def build_mask(
    document_ids: torch.Tensor | None, *, q_len: int, kv_len: int, backend: str = "sdpa",
    window: int | None = None, device: torch.device | None = None, flex_causal: bool = False,
    chunk: int | None = None,
) -> AttentionMask:
    """The mask for `q_len` queries that follow `kv_len - q_len` cached positions.

    `window`: a query sees at most the `window` latest positions, itself included
    (sliding-window attention). `chunk`: the row is cut into chunks of this many positions
    and a query sees only its own chunk's (chunked local attention, Llama 4). `flex_causal`:
    a block mask under "flex" even for plain causal rows (attention sinks need
    FlexAttention's log-sum-exp)."""
    if chunk is not None and kv_len <= chunk:
        chunk = None  # every position in one chunk: plain causal
    offset = kv_len - q_len
    if document_ids is not None:
        if offset != 0:
            raise ValueError("document_ids cannot be combined with a KV cache")
        device = document_ids.device
    device = device or torch.device("cpu")
    if backend == "flex" and offset == 0 and (document_ids is not None or window or chunk or flex_causal):
        if device.type in FLEX_DEVICES:
            return AttentionMask(block_mask=_flex_block_mask(document_ids, q_len, window, device, chunk))
        fallbacks.record("attention.flex", asked='model.attention = "flex"', instead="SDPA",
                         why=f"FlexAttention has no backward on {device.type}", fix="train on CUDA")
    one_document = document_ids is None or bool((document_ids == document_ids[:, :1]).all())
    if one_document and window is None and chunk is None:
        if offset == 0:
            return AttentionMask(is_causal=True)
        if q_len == 1:
            return AttentionMask()  # one new token sees the whole cache
    q_pos = torch.arange(offset, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = q_pos >= k_pos  # (Tq, Tk)
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    if chunk is not None:
        allowed = allowed & (q_pos // chunk == k_pos // chunk)
    allowed = allowed[None, None]  # (1, 1, Tq, Tk)
    if not one_document:
        allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])[:, None]  # (B, 1, T, T)
    return AttentionMask(dense=allowed)


def flex_mask_mod(document_ids: torch.Tensor | None, window: int | None, chunk: int | None = None):
    """FlexAttention's mask_mod: causal, within `window`, within `chunk`, within each row's
    documents (B, T)."""

    def mask_mod(b, h, q, kv):
        allowed = q >= kv
        if window is not None:
            allowed = allowed & (q - kv < window)
        if chunk is not None:
            allowed = allowed & (q // chunk == kv // chunk)
        if document_ids is not None:
            allowed = allowed & (document_ids[b, q] == document_ids[b, kv])
        return allowed

    return mask_mod


def _flex_block_mask(document_ids: torch.Tensor | None, T: int, window: int | None, device: torch.device,
                     chunk: int | None = None) -> Any:
    B = document_ids.shape[0] if document_ids is not None else None
    return _block_mask_builder(device)(flex_mask_mod(document_ids, window, chunk), B, None, T, T, device=device)


_compiled_block_mask = None


def _block_mask_builder(device: torch.device):
    """`create_block_mask`, on CUDA compiled once per process. Eager, it evaluates the
    mask_mod on every (query, key) pair at once: B * T * T booleans and the int64 document
    look-ups behind them (GiBs at 8k tokens); compiled, tile by tile. Each mask_mod is a new
    closure over the batch's document ids, which the compiled function takes as an input:
    no recompilation from one batch to the next (tests/unit/models/test_attention.py).
    create_block_mask(_compile=True) does the same but warns on every call: deprecated since
    torch 2.6 for torch.compile(create_block_mask), what torchtitan and torch's own context
    parallelism call."""
    from torch.nn.attention.flex_attention import create_block_mask

    if device.type != "cuda":
        return create_block_mask
    global _compiled_block_mask
    if _compiled_block_mask is None:
        before_compile()
        _compiled_block_mask = torch.compile(create_block_mask, dynamic=False)
    return _compiled_block_mask


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale=None, with_lse: bool = False):
    """FlexAttention's output, and with `with_lse` also the log-sum-exp of each query's
    scores (B, H, Tq), natural log."""
    # FlexAttention is only fast compiled; compile it once per process, lazily.
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if _compiled_flex is None:
        before_compile()
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    aux = AuxRequest(lse=True) if with_lse else None
    out = _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                         return_aux=aux)
    return (out[0], out[1].lse) if with_lse else out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
           scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention. q (B, H, Tq, hd); k (B, Hkv, Tk, hd); v (B, Hkv, Tk, hv)
    -> (B, H, Tq, hv). Values may be narrower than keys (latent attention). `scale`
    multiplies the scores; None means 1/sqrt(hd).

    `sinks` (H,): a learned logit per head that joins every query's softmax as one more
    "key" with no value (gpt-oss; Xiao et al. 2023, "Efficient Streaming Language Models
    with Attention Sinks"): a head may put weight on nothing. Under FlexAttention it rescales
    the output by the share the real keys keep, softmax's denominator from the returned
    log-sum-exp; elsewhere the scores are written out (SDPA cannot add the term)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mask.sequence is not None:  # the rows are split over ranks (context parallelism)
        return mask.sequence.attend(q, k, v, scale=scale, sinks=sinks)
    if sinks is not None and mask.block_mask is not None:
        out, lse = _flex_attention(q, k, v, mask.block_mask, scale, with_lse=True)  # lse (B, H, Tq)
        return rescale_for_sinks(out, lse, sinks)
    if sinks is not None:
        return _attend_with_sinks(q, k, v, mask, scale, sinks)
    if mask.block_mask is not None:
        return _flex_attention(q, k, v, mask.block_mask, scale)
    attn_mask = mask.dense.to(q.device) if mask.dense is not None else None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=mask.is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def rescale_for_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention out (B, H, Tq, hv) over the real keys, with the log-sum-exp lse (B, H, Tq) of
    their scores, as if each head's sink (H,) had joined the softmax: times the share the real
    keys keep, e^lse / (e^lse + e^sink)."""
    kept = torch.sigmoid(lse - sinks.float()[None, :, None])
    return out * kept.unsqueeze(-1).to(out.dtype)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sink logits, the scores materialized (B, H, Tq, Tk) in fp32 (fp64 for fp64 q)."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    if q.device.type == "cuda":
        fallbacks.record("attention.sinks", asked="attention sinks", instead="attention with the scores written out",
                         why="SDPA cannot add a sink to the softmax", fix='model.attention = "flex"')
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, Tk, hd)
    scores = (at_least_fp32(q) @ at_least_fp32(k).transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if mask.dense is not None:
        allowed = mask.dense.to(q.device)
    elif mask.is_causal:  # queries are the last Tq positions of the Tk
        q_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
        allowed = q_pos >= torch.arange(Tk, device=q.device)[None, :]
    else:
        allowed = None
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, Tq, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :Tk]  # the sink's share dropped
    return (probs @ at_least_fp32(v)).to(q.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its RMS over the last dim, in fp32 (fp64 for fp64 x; a weightless RMSNorm)."""
    xf = at_least_fp32(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class KVCache:
    """Keys and values of every layer for positions already decoded.

    Buffers are preallocated for `max_len` positions; `length` counts those filled.
    The model writes each layer's new keys/values through `update` and calls
    `advance` once per forward pass. `value_dim` is the values' width when it differs
    from the keys' `head_dim` (latent attention); None means the same.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str, value_dim: int | None = None,
                 layers: list[int] | None = None):
        shape = (batch, n_kv_heads, max_len, head_dim)
        value_shape = (batch, n_kv_heads, max_len, value_dim or head_dim)
        held = set(range(n_layers) if layers is None else layers)  # the attention layers: they need keys

        def buffer(i: int, shape: tuple[int, ...]) -> torch.Tensor | None:
            return torch.zeros(shape, dtype=dtype, device=device) if i in held else None

        self.keys = [buffer(i, shape) for i in range(n_layers)]
        self.values = [buffer(i, value_shape) for i in range(n_layers)]
        self.max_len = max_len
        self.length = 0
        # layer -> the recurrent state of a sequence mixer that is not attention (linear
        # attention's convolution window and state), kept by the mixer itself.
        self.mixer_states: dict[int, Any] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, hd) after the cached positions; return all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} were asked for")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


class Attention(MaxLogitTracking, nn.Module):
    """Multi-head self-attention with n_kv_heads <= n_heads (grouped-query when fewer).

    Optional per-head RMSNorm of queries and keys (QK-norm) before RoPE, and learned
    attention sinks (`attend`). When cos/sin are None (GPT-2), positions come from learned
    embeddings instead of rotations. `out_bias` differs from `bias` where a family's output
    projection does (None: the same). `qk_norm_over_heads`: QK-norm over the whole query and
    key projections (n_heads * head_dim wide) before the split into heads, as OLMo 2/3 do,
    instead of per head. `scale` multiplies the scores; None means 1/sqrt(head_dim) (Gemma 3
    uses query_pre_attn_scalar ** -0.5).

    Llama 4's options: `rotary=False` ignores the block's rotary tables (a NoPE layer);
    `unit_qk=True` divides each head's query and key by their RMS (no weight, eps `norm_eps`)
    after RoPE; `temperature=(floor_scale, attn_scale)` multiplies each query at position p
    by 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)), the mask's `positions` giving p
    (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399).

    `value_embedding=True` (the speedrun's value embeddings, modded-nanogpt 2024-2025): the
    forward's `value` (B, T, Hkv * hd), a lookup of the tokens, mixes into the values as
    v = lambda_0 v + lambda_1 value, the two learned scalars `value_lambdas` starting at 0.5.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-5, fused_rope: bool = False,
                 sinks: bool = False, out_bias: bool | None = None, output_gate: bool = False,
                 rotary_dim: int | None = None, zero_centered_norm: bool = False,
                 qk_norm_over_heads: bool = False, scale: float | None = None, rotary: bool = True,
                 unit_qk: bool = False, temperature: tuple[int, float] | None = None,
                 value_embedding: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.scale = scale
        self.rotary, self.unit_qk, self.temperature, self.norm_eps = rotary, unit_qk, temperature, norm_eps
        self.qk_norm_over_heads = qk_norm_over_heads
        self.fused_rope = fused_rope
        self.rotary_dim = rotary_dim if rotary_dim is not None else head_dim  # the leading dims RoPE turns
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        # Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models"): each
        # head's output times sigmoid of its own projection of x, before wo.
        self.wg = nn.Linear(dim, n_heads * head_dim, bias=bias) if output_gate else None
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias if out_bias is None else out_bias)
        q_width, k_width = (n_heads * head_dim, n_kv_heads * head_dim) if qk_norm_over_heads else (head_dim, head_dim)
        self.q_norm = RMSNorm(q_width, norm_eps, zero_centered=zero_centered_norm) if qk_norm else None
        self.k_norm = RMSNorm(k_width, norm_eps, zero_centered=zero_centered_norm) if qk_norm else None
        # One learned logit per query head (see `attend`); under TP sharded with the heads.
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.value_lambdas = nn.Parameter(torch.empty(2)) if value_embedding else None

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"mixer": "attention", "output_gate": self.wg is not None, "sinks": self.sinks is not None,
                "unit_qk": getattr(self, "unit_qk", False)}  # a subclass with its own __init__ (Gemma 4) has none

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: AttentionMask, cache: KVCache | None = None, layer: int = 0,
                value: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k = self.wq(x), self.wk(x)  # (B, T, H * hd), (B, T, Hkv * hd)
        if self.q_norm is not None and self.qk_norm_over_heads:  # one RMS over all heads together
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of heads.
        q = q.view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, Hkv, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if value is not None:  # (B, T, Hkv * hd): the tokens' value embedding
            v = self.value_lambdas[0] * v + self.value_lambdas[1] * value.view_as(v)
        if self.q_norm is not None and not self.qk_norm_over_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None and self.rotary:
            q, k = self.rotate(q, k, rope)
        if self.unit_qk:
            q, k = unit_rms(q, self.norm_eps), unit_rms(k, self.norm_eps)
        if self.temperature is not None:
            q = self.tempered(q, mask.positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        scale = self.head_dim**-0.5 if self.scale is None else self.scale
        self.track_logits(q, k, mask, scale)
        out = attend(q, k, v, mask, scale=scale, sinks=self.sinks).transpose(1, 2).reshape(B, T, -1)  # (B, T, H*hd)
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x))
        return self.wo(out)

    def tempered(self, q: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """q (B, T, H, hd) times its position's attention temperature (`temperature`)."""
        if positions is None:
            raise ValueError("attention temperature needs the queries' positions (AttentionMask.positions)")
        floor_scale, attn_scale = self.temperature
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # (T,)
        return (q * scales[None, :, None, None]).to(q.dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """RoPE on q (B, T, H, hd) and k (B, T, Hkv, hd); with a partial rotary width only their
        leading `rotary_dim` dims turn and the rest pass through (Qwen3.5, Qwen3-Next)."""
        r = self.rotary_dim
        if r < self.head_dim:
            (q_rot, q_pass), (k_rot, k_pass) = q.split([r, self.head_dim - r], -1), k.split([r, self.head_dim - r], -1)
            q_rot, k_rot = self.rotate_full(q_rot.contiguous(), k_rot.contiguous(), rope)
            return torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1)
        return self.rotate_full(q, k, rope)

    def rotate_full(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        if self.fused_rope:
            from forja.ops import rope as fused_rope

            return fused_rope(q, k, *rope)
        return apply_rope(q, *rope), apply_rope(k, *rope)
