"""Gated DeltaNet as a sequence mixer (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks"):
the linear-attention layer of Qwen3.5, Qwen3-Next and OLMo-Hybrid.

    q, k, v = silu(causal_conv(x W_q)), ...   short depthwise convolutions, kernel K
    beta    = sigmoid(x W_b)                   (x 2 with allow_neg_eigval: eigenvalues in (-1, 1))
    g       = -exp(A_log) softplus(x W_a + dt_bias)   log decay per value head, <= 0
    o       = gated_delta_rule(q, k, v, g, beta)      (forja.models.common.gated_delta_rule)
    out     = W_o (rmsnorm(o) * silu(x W_z))          a gated RMSNorm over each value head

It takes Attention's place in a TransformerBlock: the same call, `rope` ignored (the
convolution and the decay carry position). Packed documents (`mask.document_ids`) are kept
apart both in the state and in the convolution's window. Decoding keeps, per layer in
`cache.mixer_states`, the last K - 1 inputs of each convolution and the recurrent state.

Projections are separate (wq, wk, wv, wz, wb, wa), so tensor parallelism can shard them
by head; shapes below use -1 for head counts for that reason.

A family with Gated DeltaNet blocks lists `GatedDeltaNetArgs` first among its args' bases:
the mixer's fields, their validation, the blocks it builds and what they cost, declared once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache
from forja.models.common.gated_delta_rule import gated_delta_rule, gated_delta_rule_flops
from forja.models.common.precision import at_least_fp32


@dataclass
class GatedDeltaNetState:
    """One layer's decoding state, kept in `KVCache.mixer_states[layer]`."""

    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """the last K - 1 inputs of conv_q, conv_k, conv_v, each (B, K - 1, channels)"""
    recurrent: torch.Tensor
    """(B, Hv, dk, dv) fp32, the gated delta rule's state"""


def causal_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution (plus `bias` (C,) when given: Mamba-2's), then SiLU. x (B, T, C);
    weight (C, 1, K); window (B, K - 1, C) the inputs just before x (zeros when None). With
    `document_ids` (B, T) a token sees no earlier document's inputs (the row's first document
    does see `window`). -> (out (B, T, C) in x's dtype, the new window: the last K - 1 inputs)."""
    B, T, C = x.shape
    K = weight.shape[-1]
    dtype = x.dtype
    x = x.to(weight.dtype)  # as transformers: the convolution runs in the weight's dtype
    if window is None:
        window = x.new_zeros(B, K - 1, C)
    ext = torch.cat([window.to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
    if document_ids is None:
        out = F.conv1d(ext.transpose(1, 2), weight, bias, groups=C).transpose(1, 2)  # (B, T, C)
    else:
        out = _conv_within_documents(ext, weight, document_ids)
        out = out if bias is None else out + bias
    return F.silu(out).to(dtype), ext[:, ext.shape[1] - (K - 1):]


def _conv_within_documents(ext: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """The convolution as K shifted products, each input masked where it lies before the
    token's document: K elementwise terms, no (B, T, C, K) window tensor."""
    B, T = document_ids.shape
    K = weight.shape[-1]
    later_start = torch.zeros_like(document_ids, dtype=torch.bool)
    later_start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    pos = torch.arange(T, device=ext.device).expand(B, T)
    # Tokens since the document's first (the row's first document: far enough to see the window).
    since_start = pos - torch.where(later_start, pos, -K).cummax(1).values  # (B, T)
    out = ext.new_zeros(B, T, ext.shape[-1])
    for i in range(K):  # ext[:, i + t] is token t - lag
        lag = K - 1 - i
        seen = (since_start >= lag).to(ext.dtype)[..., None]  # (B, T, 1)
        out = out + ext[:, i:i + T] * weight[:, 0, i] * seen
    return out


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head, times silu(gate): weight * norm(x) * silu(z), the norm in
    fp32 (fp64 for fp64 x) and cast back before the weight (as transformers' Qwen3.5 and OLMo-Hybrid)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = at_least_fp32(x)
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(at_least_fp32(gate))).to(dtype)


class DeltaRuleMixer(nn.Module):
    """What Gated DeltaNet and Kimi Delta Attention share: three short convolutions over the
    q, k, v projections, then a delta rule (`delta_rule`, each subclass's) on a state of
    (dk, dv) per value head. A subclass sets conv_q, conv_k, conv_v, head_k_dim, head_v_dim
    and chunk_size."""

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                   initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                   document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mixer's rule on convolved q, k (B, T, Hk, dk), v (B, T, Hv, dv), its decay g and
        beta -> (o (B, T, Hv, dv), the final state (B, Hv, dk, dv) when asked)."""
        raise NotImplementedError

    def run(self, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            mask: AttentionMask, cache: KVCache | None, layer: int) -> torch.Tensor:
        """`mix` for a forward: over the ranks' slices of the rows (context parallelism, the
        mask's `sequence`), or here after the cache's state, keeping the new one -> o (B, T, Hv, dv)."""
        if mask.sequence is not None:
            return mask.sequence.gated_delta(self, q_in, k_in, v_in, g, beta)
        state = cache.mixer_states.get(layer) if cache is not None else None
        o, state = self.mix(q_in, k_in, v_in, g, beta, mask.document_ids, state=state, keep_state=cache is not None)
        if cache is not None:
            cache.mixer_states[layer] = state
        return o

    def mix(self, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            document_ids: torch.Tensor | None = None, *, state: GatedDeltaNetState | None = None,
            keep_state: bool = False, channels: tuple[slice, slice] | None = None,
            ) -> tuple[torch.Tensor, GatedDeltaNetState | None]:
        """The convolutions and the delta rule from the projections q_in, k_in (B, T, Hk dk),
        v_in (B, T, Hv dv), g (B, T, Hv; (B, T, Hv, dk) for a channel-wise decay) and beta
        (B, T, Hv), after `state` (None: from nothing) -> (o (B, T, Hv, dv), the state after
        them when `keep_state`). `channels`: the key and value channels these projections
        hold, when they are some of the heads (context parallelism's all-to-all); None: all."""
        windows = state.conv if state is not None else (None, None, None)
        q, k, v, windows = self.convolve(q_in, k_in, v_in, document_ids, windows, channels)
        o, S = self.delta_rule(q, k, v, g, beta, initial_state=state.recurrent if state is not None else None,
                               output_final_state=keep_state, document_ids=document_ids)  # (B, T, Hv, dv)
        return o, GatedDeltaNetState(conv=windows, recurrent=S) if keep_state else None

    def convolve(self, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor,
                 document_ids: torch.Tensor | None = None, windows: tuple = (None, None, None),
                 channels: tuple[slice, slice] | None = None) -> tuple:
        """The three short convolutions (each after its `windows`, the inputs just before)
        -> q, k (B, T, Hk, dk), v (B, T, Hv, dv) and the new windows, as `mix`."""
        B, T, _ = q_in.shape
        keys, values = channels if channels is not None else (slice(None), slice(None))
        weights = (self.conv_q.weight[keys], self.conv_k.weight[keys], self.conv_v.weight[values])
        outs = [causal_conv(x, w, window, document_ids) for x, w, window in zip((q_in, k_in, v_in), weights, windows)]
        (q, q_window), (k, k_window), (v, v_window) = outs
        q = q.view(B, T, -1, self.head_k_dim)  # (B, T, Hk, dk)
        k = k.view(B, T, -1, self.head_k_dim)
        v = v.view(B, T, -1, self.head_v_dim)  # (B, T, Hv, dv)
        return q, k, v, (q_window, k_window, v_window)


class GatedDeltaNet(DeltaRuleMixer):
    """Gated DeltaNet with n_k_heads query/key heads, each shared by n_v_heads / n_k_heads
    consecutive value heads. `norm_eps`: the gated output norm's epsilon (Qwen3.5: the
    model's rms_norm_eps; OLMo-Hybrid: 1e-5). `allow_neg_eigval` doubles beta (OLMo-Hybrid).
    `chunk_size`: the chunked reference's chunk (fla's kernel uses its own, 64)."""

    def __init__(self, dim: int, *, n_k_heads: int, n_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, allow_neg_eigval: bool = False,
                 chunk_size: int = 64):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"GatedDeltaNet's n_v_heads ({n_v_heads}) must be a multiple of n_k_heads "
                             f"({n_k_heads}); choose head counts where it is")
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.allow_neg_eigval = allow_neg_eigval
        self.chunk_size = chunk_size
        key_dim, value_dim = n_k_heads * head_k_dim, n_v_heads * head_v_dim
        self.wq = nn.Linear(dim, key_dim, bias=False)
        self.wk = nn.Linear(dim, key_dim, bias=False)
        self.wv = nn.Linear(dim, value_dim, bias=False)
        self.wz = nn.Linear(dim, value_dim, bias=False)  # the output gate
        self.wb = nn.Linear(dim, n_v_heads, bias=False)  # beta, the write strength
        self.wa = nn.Linear(dim, n_v_heads, bias=False)  # the decay's input
        self.wo = nn.Linear(value_dim, dim, bias=False)
        self.conv_q, self.conv_k, self.conv_v = (
            nn.Conv1d(c, c, conv_kernel, groups=c, bias=False) for c in (key_dim, key_dim, value_dim))
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.shape = (n_k_heads, n_v_heads, head_k_dim, head_v_dim, conv_kernel, chunk_size)

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"mixer": "gated_deltanet", "gated_deltanet": self.shape}

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: AttentionMask, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q_in, k_in, v_in = self.wq(x), self.wk(x), self.wv(x)  # (B, T, channels), before the convolutions
        beta = self.wb(x).sigmoid()  # (B, T, Hv)
        if self.allow_neg_eigval:
            beta = beta * 2.0
        # at least fp32: in half precision exp(A_log) may overflow
        g = -at_least_fp32(self.A_log).exp() * F.softplus(at_least_fp32(self.wa(x)) + self.dt_bias)  # (B, T, Hv)
        o = self.run(q_in, k_in, v_in, g, beta, mask, cache, layer)  # (B, T, Hv, dv)
        z = self.wz(x).view(B, T, -1, self.head_v_dim)
        return self.wo(self.norm(o, z).reshape(B, T, -1))

    def delta_rule(self, q, k, v, g, beta, *, initial_state=None, output_final_state=False, document_ids=None):
        return gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=initial_state,
                                output_final_state=output_final_state, document_ids=document_ids)


def gated_deltanet_init_rule(name: str, *, conv_kernel: int = 4, dt_bias: str = "ones") -> tuple | None:
    """The init rule (forja.models.common.init) of a Gated DeltaNet's own parameters, by the
    parameter's name; None for those the host model's rule decides (projections; `norm.weight`
    is ones as every norm's). A = exp(A_log) ~ U(0.01, 16), as transformers' Qwen3.5;
    dt_bias "ones" (Qwen3.5) or "inv_softplus" (OLMo-Hybrid: softplus(dt_bias) log-uniform in
    [0.001, 0.1], at least 1e-4); the convolutions as PyTorch's default for a depthwise
    kernel (fan-in K), which fla's short convolution keeps."""
    leaf = name.rsplit(".", 2)
    if name == "A_log" or name.endswith(".A_log"):
        return ("uniform_log", 0.01, 16.0)
    if name == "dt_bias" or name.endswith(".dt_bias"):
        if dt_bias == "ones":
            return ("ones",)
        if dt_bias == "inv_softplus":
            return ("inv_softplus", 0.001, 0.1, 1e-4)
        raise ValueError(f"unknown dt_bias init {dt_bias!r}; use 'ones' or 'inv_softplus'")
    if len(leaf) >= 2 and leaf[-2] in ("conv_q", "conv_k", "conv_v") and leaf[-1] == "weight":
        bound = conv_kernel**-0.5
        return ("uniform", -bound, bound)
    return None


@dataclass(kw_only=True)
class GatedDeltaNetArgs:
    """The Gated DeltaNet fields of a family whose `layer_types` hold linear_attention blocks
    (Qwen3.5, Qwen3-Next, OLMo-Hybrid); listed before TransformerArgs among the bases, whose
    fields (dim, layer_type) it reads. Defaults: Qwen3.5's."""

    linear_n_k_heads: int = 16
    """Gated DeltaNet query/key heads."""
    linear_n_v_heads: int = 32
    """Gated DeltaNet value heads (a multiple of the key heads, which are repeated)."""
    linear_k_head_dim: int = 128
    """Width of a Gated DeltaNet query/key head; each value head's recurrent state is
    linear_k_head_dim x linear_v_head_dim."""
    linear_v_head_dim: int = 128
    """Width of a Gated DeltaNet value head."""
    linear_conv_kernel: int = 4
    """Taps of the short causal convolutions before the delta rule."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear_n_v_heads % self.linear_n_k_heads:
            raise ForjaError(f"model.linear_n_v_heads={self.linear_n_v_heads} is not a multiple of "
                             f"model.linear_n_k_heads={self.linear_n_k_heads}; Gated DeltaNet repeats whole key heads")

    @property
    def supported_layer_types(self) -> tuple[str, ...]:
        return ("full_attention", "linear_attention")

    def head_counts(self) -> dict[str, int]:
        counts = super().head_counts()
        if "linear_attention" in self.layer_types:  # Gated DeltaNet splits by whole key heads
            counts.update(linear_n_k_heads=self.linear_n_k_heads, linear_n_v_heads=self.linear_n_v_heads)
        return counts

    def gated_deltanet(self, norm_eps: float, allow_neg_eigval: bool = False) -> GatedDeltaNet:
        """A linear-attention block's mixer; `norm_eps`: its gated output norm's."""
        return GatedDeltaNet(self.dim, n_k_heads=self.linear_n_k_heads, n_v_heads=self.linear_n_v_heads,
                             head_k_dim=self.linear_k_head_dim, head_v_dim=self.linear_v_head_dim,
                             conv_kernel=self.linear_conv_kernel, norm_eps=norm_eps, allow_neg_eigval=allow_neg_eigval)

    def linear_attention_flops(self, seq_len: int) -> int:
        """Training FLOPs per token of one linear-attention block's delta rule (Transformer.mixer_flops)."""
        return gated_delta_rule_flops(self.linear_n_v_heads, self.linear_k_head_dim, self.linear_v_head_dim, seq_len)

    def linear_init_rule(self, name: str) -> tuple | None:
        """`gated_deltanet_init_rule` for a parameter of a linear-attention block ("layers.{i}...."),
        None for every other parameter."""
        if name.startswith("layers.") and self.layer_type(int(name.split(".")[1])) == "linear_attention":
            return gated_deltanet_init_rule(name, conv_kernel=self.linear_conv_kernel)
        return None
