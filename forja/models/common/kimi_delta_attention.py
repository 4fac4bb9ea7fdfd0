"""Kimi Delta Attention (KDA) as a sequence mixer (Kimi Team 2025, "Kimi Linear: An Expressive,
Efficient Attention Architecture", arXiv 2510.26692): the linear-attention layer of Kimi Linear.

Gated DeltaNet (forja/models/common/gated_deltanet.py) with a finer forget gate: the decay is
a vector over each head's key channels, produced by a low-rank projection, and the output
gate is low-rank too:

    q, k, v = silu(causal_conv(x W_q)), ...            short depthwise convolutions, kernel K
    beta    = sigmoid(x W_b)                            one write strength per head
    g       = -exp(A_log) softplus(x W_fa W_fb + dt_bias)   log decay per head and key channel, <= 0
    o       = kimi_delta_rule(q, k, v, g, beta)         (forja/models/common/kimi_delta_rule.py)
    out     = W_o (rmsnorm(o) * sigmoid(x W_ga W_gb))   a sigmoid-gated RMSNorm over each head

Queries, keys and values have the same head count and width (H heads of d). The convolutions
and the way a state is carried are Gated DeltaNet's (`DeltaRuleMixer`), and so is context
parallelism (the rule stays affine in its state with a channel-wise decay). It takes
Attention's place in a TransformerBlock (`rope` ignored: the convolutions and decays carry
position). Packed documents (`mask.document_ids`) are kept apart in the state and in the
convolutions' windows. Decoding keeps, per layer in `cache.mixer_states`, the last K - 1
inputs of each convolution and the recurrent state, as Gated DeltaNet does.

Projections into heads (wq, wk, wv, wb, wf_b, wg_b) are separate, so tensor parallelism
splits them by head; the rank-d projections wf_a and wg_a stay whole. Shapes below use -1
for head counts for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache
from forja.models.common.gated_deltanet import DeltaRuleMixer, gated_deltanet_init_rule
from forja.models.common.kimi_delta_rule import DEFAULT_CHUNK, kimi_delta_rule, kimi_delta_rule_flops
from forja.models.common.precision import at_least_fp32


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm of each head times sigmoid(gate), all in fp32 (fp64 for fp64 x; the weight
    included), cast back at the end: fla's and transformers' Kimi Linear output norm."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(x32.dtype) * normed * at_least_fp32(gate).sigmoid()).to(dtype)


class KimiDeltaAttention(DeltaRuleMixer):
    """KDA over n_heads heads of head_dim channels (queries, keys and values alike).
    `norm_eps`: the gated output norm's epsilon (Kimi Linear: the model's rms_norm_eps);
    `chunk_size`: the chunked reference's chunk (fla's kernel uses its own)."""

    def __init__(self, dim: int, *, n_heads: int, head_dim: int, conv_kernel: int = 4, norm_eps: float = 1e-5,
                 chunk_size: int = DEFAULT_CHUNK):
        super().__init__()
        self.head_k_dim = self.head_v_dim = head_dim  # the names Gated DeltaNet's readers use
        self.chunk_size = chunk_size
        width = n_heads * head_dim
        self.wq = nn.Linear(dim, width, bias=False)
        self.wk = nn.Linear(dim, width, bias=False)
        self.wv = nn.Linear(dim, width, bias=False)
        self.wb = nn.Linear(dim, n_heads, bias=False)  # beta, the write strength
        self.wf_a = nn.Linear(dim, head_dim, bias=False)  # the decay's low-rank input
        self.wf_b = nn.Linear(head_dim, width, bias=False)
        self.wg_a = nn.Linear(dim, head_dim, bias=False)  # the output gate's low-rank input
        self.wg_b = nn.Linear(head_dim, width, bias=False)
        self.wo = nn.Linear(width, dim, bias=False)
        self.conv_q, self.conv_k, self.conv_v = (
            nn.Conv1d(width, width, conv_kernel, groups=width, bias=False) for _ in range(3))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.norm = SigmoidGatedRMSNorm(head_dim, norm_eps)
        self.shape = (n_heads, n_heads, head_dim, head_dim, conv_kernel, chunk_size)

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py): its
        shape in Gated DeltaNet's terms (as many key as value heads), which the planner reads."""
        return {"mixer": "kimi_delta_attention", "gated_deltanet": self.shape}

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim) -> g (B, T, H, d) fp32 (fp64 for fp64 x), the log decay of each head's key
        channels: -exp(A_log) softplus(x W_fa W_fb + dt_bias), in fp32 where exp(A_log) may be large."""
        B, T, _ = x.shape
        f = at_least_fp32(self.wf_b(self.wf_a(x)))
        f = (f + self.dt_bias.to(f.dtype)).view(B, T, -1, self.head_k_dim)
        # softplus as transformers writes it, log(1 + exp(f)) (linear above 20), so that both
        # round alike: it runs in fp32 whatever the model's dtype (fp64 in fp64), on both sides.
        softplus = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
        return -self.A_log.to(f.dtype).exp()[:, None] * softplus  # (B, T, H, d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: AttentionMask, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q_in, k_in, v_in = self.wq(x), self.wk(x), self.wv(x)  # (B, T, H d), before the convolutions
        beta = self.wb(x).sigmoid()  # (B, T, H)
        g = self.decay(x)  # (B, T, H, d)
        o = self.run(q_in, k_in, v_in, g, beta, mask, cache, layer)  # (B, T, H, d)
        gate = self.wg_b(self.wg_a(x)).view(B, T, -1, self.head_v_dim)  # (B, T, H, d)
        return self.wo(self.norm(o, gate).reshape(B, T, -1))

    def delta_rule(self, q, k, v, g, beta, *, initial_state=None, output_final_state=False, document_ids=None):
        return kimi_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=initial_state,
                               output_final_state=output_final_state, document_ids=document_ids)


def kimi_delta_init_rule(name: str, *, conv_kernel: int = 4) -> tuple | None:
    """The init rule (forja.models.common.init) of a KDA's own parameters, by name; None for
    those the host model's rule decides (projections; `norm.weight` ones as every norm's).
    As fla's initialization, which transformers' Kimi Linear follows: A = exp(A_log) ~
    U(1, 16); softplus(dt_bias) log-uniform in [0.001, 0.1], at least 1e-4; the
    convolutions as PyTorch's default for a depthwise kernel."""
    if name == "A_log" or name.endswith(".A_log"):
        return ("uniform_log", 1.0, 16.0)
    if name == "dt_bias" or name.endswith(".dt_bias"):
        return ("inv_softplus", 0.001, 0.1, 1e-4)
    return gated_deltanet_init_rule(name, conv_kernel=conv_kernel)


@dataclass(kw_only=True)
class KimiDeltaArgs:
    """The KDA fields of a family whose `layer_types` hold linear_attention blocks of it (Kimi
    Linear); listed before TransformerArgs among the bases, whose fields (dim, layer_type) it
    reads. Defaults: Kimi-Linear-48B-A3B's."""

    linear_n_heads: int = 32
    """KDA heads (queries, keys and values alike)."""
    linear_head_dim: int = 128
    """Width of a KDA head; each head's recurrent state is linear_head_dim x linear_head_dim,
    and the rank of the decay's and the output gate's low-rank projections."""
    linear_conv_kernel: int = 4
    """Taps of the short causal convolutions before the delta rule."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("linear_n_heads", "linear_head_dim", "linear_conv_kernel"):
            if getattr(self, name) < 1:
                raise ForjaError(f"model.{name}={getattr(self, name)} must be at least 1")

    @property
    def supported_layer_types(self) -> tuple[str, ...]:
        return ("full_attention", "linear_attention")

    def head_counts(self) -> dict[str, int]:
        counts = super().head_counts()
        if "linear_attention" in self.layer_types:  # KDA splits by whole heads
            counts.update(linear_n_heads=self.linear_n_heads)
        return counts

    def kimi_delta(self, norm_eps: float) -> KimiDeltaAttention:
        """A linear-attention block's mixer; `norm_eps`: its gated output norm's."""
        return KimiDeltaAttention(self.dim, n_heads=self.linear_n_heads, head_dim=self.linear_head_dim,
                                  conv_kernel=self.linear_conv_kernel, norm_eps=norm_eps)

    def linear_attention_flops(self, seq_len: int) -> int:
        """Training FLOPs per token of one linear-attention block's delta rule (Transformer.mixer_flops)."""
        return kimi_delta_rule_flops(self.linear_n_heads, self.linear_head_dim, seq_len)

    def linear_init_rule(self, name: str) -> tuple | None:
        """`kimi_delta_init_rule` for a parameter of a linear-attention block ("layers.{i}...."),
        None for every other parameter."""
        if name.startswith("layers.") and self.layer_type(int(name.split(".")[1])) == "linear_attention":
            return kimi_delta_init_rule(name, conv_kernel=self.linear_conv_kernel)
        return None
