"""Mamba-2 as a sequence mixer (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and
Efficient Algorithms Through Structured State Space Duality", arXiv 2405.21060): the
state-space layer of Nemotron-H.

    z, x, B, C, dt = x W_z, x W_x, x W_B, x W_C, x W_dt      the input projections
    x, B, C = silu(causal_conv(x)), ...                     short depthwise convolutions (with bias)
    dt      = clamp(softplus(dt + dt_bias), *dt_limit)      a time step per head
    y       = scan(x, dt, A = -exp(A_log), B, C) + D x      forja/models/common/mamba2_scan.py
    out     = W_o norm(y * silu(z))                         an RMSNorm over each of n_groups groups

It takes Attention's place in a block: the same call, `rope` ignored (the convolution and the
decay carry position). Packed documents (`mask.document_ids`) are kept apart both in the state
and in the convolution's window. Decoding keeps, per layer in `cache.mixer_states`, the last
K - 1 inputs of each convolution and the scan's state.

Hugging Face fuses the projections into one `in_proj` (rows z | x | B | C | dt) and the
convolutions into one `conv1d` (channels x | B | C); forja keeps them apart so tensor
parallelism can split them by head and group: a rank holds whole groups, their heads and
their channels of the gated norm, whose groups then lie whole on one rank. Shapes use -1 for
head counts for that reason.

A family with Mamba-2 blocks lists `Mamba2Args` first among its args' bases: the mixer's
fields, their validation, the mixer it builds, its initialization and FLOPs, declared once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forja.errors import ForjaError
from forja.models.common.attention import AttentionMask, KVCache
from forja.models.common.gated_deltanet import causal_conv
from forja.models.common.mamba2_scan import causal_conv1d_kernel, mamba2_scan, mamba2_scan_flops


@dataclass
class Mamba2State:
    """One layer's decoding state, kept in `KVCache.mixer_states[layer]`."""

    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """the last K - 1 inputs of conv_x, conv_B, conv_C, each (B, K - 1, channels)"""
    ssm: torch.Tensor
    """(B, H, P, N) in float32 (float64 for a float64 model), the scan's state"""


class GroupedGatedRMSNorm(nn.Module):
    """weight * rmsnorm(x * silu(z)) with the RMS taken over each group of `group_size`
    channels (Mamba-2's norm after the gate): in fp32, cast back before the weight."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        compute = torch.promote_types(dtype, torch.float32)
        h = x.to(compute) * F.silu(gate.to(compute))
        groups = h.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(dtype)


class Mamba2(nn.Module):
    """Mamba-2 with n_heads heads of head_dim channels in n_groups groups sharing B and C
    (state_size wide). `chunk_size`: the chunked scan's. `dt_limit`: the time step's clamp.
    `bias`: biases on the input and output projections; `conv_bias`: on the convolutions."""

    def __init__(self, dim: int, *, n_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int = 4, chunk_size: int = 128, dt_limit: tuple[float, float] = (0.0, math.inf),
                 bias: bool = False, conv_bias: bool = True, norm_eps: float = 1e-5):
        super().__init__()
        if n_heads % n_groups:
            raise ValueError(f"Mamba2's n_heads ({n_heads}) must be a multiple of n_groups ({n_groups})")
        self.head_dim, self.state_size, self.chunk_size = head_dim, state_size, chunk_size
        self.dt_limit = tuple(dt_limit)
        inner, bc = n_heads * head_dim, n_groups * state_size
        self.wz = nn.Linear(dim, inner, bias=bias)  # the gate
        self.wx = nn.Linear(dim, inner, bias=bias)
        self.wB = nn.Linear(dim, bc, bias=bias)
        self.wC = nn.Linear(dim, bc, bias=bias)
        self.wdt = nn.Linear(dim, n_heads, bias=bias)
        self.conv_x, self.conv_B, self.conv_C = (
            nn.Conv1d(c, c, conv_kernel, groups=c, bias=conv_bias) for c in (inner, bc, bc))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.dt_bias = nn.Parameter(torch.zeros(n_heads))
        self.norm = GroupedGatedRMSNorm(inner, inner // n_groups, norm_eps)
        self.wo = nn.Linear(inner, dim, bias=bias)
        self.shape = (n_heads, head_dim, n_groups, state_size, conv_kernel, chunk_size)

    def structure_fields(self) -> dict:
        """What it adds to its block's structure record (forja/models/common/blocks.py)."""
        return {"mixer": "mamba2", "mamba2": self.shape}

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: AttentionMask | None, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        x_in, B_in, C_in = self.wx(x), self.wB(x), self.wC(x)  # (B, T, H P), (B, T, G N) twice
        dt = self.time_steps(x)  # (B, T, H)
        if mask is not None and mask.sequence is not None:  # the rows are split over ranks (context parallelism)
            y = mask.sequence.mamba2(self, x_in, B_in, C_in, dt)
        else:
            state = cache.mixer_states.get(layer) if cache is not None else None
            y, state = self.mix(x_in, B_in, C_in, dt, mask.document_ids if mask is not None else None, state)
            if cache is not None:
                cache.mixer_states[layer] = state
        y = self.norm(y.reshape(B, T, -1), self.wz(x))  # y (B, T, H, P) in the compute dtype
        return self.wo(y.to(x.dtype))

    def time_steps(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim) -> dt (B, T, H) in the compute dtype: softplus(x W_dt + dt_bias), clamped."""
        compute = torch.promote_types(x.dtype, torch.float32)
        dt = F.softplus(self.wdt(x).to(compute) + self.dt_bias.to(compute))
        return dt.clamp(min=self.dt_limit[0], max=self.dt_limit[1])

    def mix(self, x_in: torch.Tensor, B_in: torch.Tensor, C_in: torch.Tensor, dt: torch.Tensor,
            document_ids: torch.Tensor | None = None, state: Mamba2State | None = None,
            heads: slice | None = None) -> tuple[torch.Tensor, Mamba2State]:
        """The convolutions and the scan (with the D skip) from the projections x_in (B, T, H P),
        B_in, C_in (B, T, G N) and the time steps dt (B, T, H), after `state` (None: from
        nothing) -> (y (B, T, H, P) in the compute dtype, the state after). `heads`: the heads
        these inputs hold, with their groups' B and C, when they are some of them (context
        parallelism's all-to-all); None: all."""
        windows = state.conv if state is not None else (None, None, None)
        xs, Bs, Cs, windows = self.convolve(x_in, B_in, C_in, document_ids, windows, heads)
        y, S = self.scan(xs, dt, Bs, Cs, document_ids, state.ssm if state is not None else None, heads)
        return y, Mamba2State(conv=windows, ssm=S)

    def convolve(self, x_in: torch.Tensor, B_in: torch.Tensor, C_in: torch.Tensor,
                 document_ids: torch.Tensor | None = None, windows: tuple = (None, None, None),
                 heads: slice | None = None) -> tuple:
        """The three short convolutions (each after its `windows`, the inputs just before)
        -> xs (B, T, H, P), Bs, Cs (B, T, G, N) and the new windows, as `mix`."""
        B, T, _ = x_in.shape
        inner, groups = self._channels(heads, B_in.shape[-1])
        parts = (inner, groups, groups)
        outs = [_convolve(t, conv, part, window, document_ids) for t, conv, part, window
                in zip((x_in, B_in, C_in), (self.conv_x, self.conv_B, self.conv_C), parts, windows, strict=True)]
        (xs, x_window), (Bs, B_window), (Cs, C_window) = outs
        xs = xs.view(B, T, -1, self.head_dim)  # (B, T, H, P)
        Bs, Cs = (t.view(B, T, -1, self.state_size) for t in (Bs, Cs))  # (B, T, G, N)
        return xs, Bs, Cs, (x_window, B_window, C_window)

    def scan(self, xs: torch.Tensor, dt: torch.Tensor, Bs: torch.Tensor, Cs: torch.Tensor,
             document_ids: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
             heads: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scan of the convolved inputs plus the D skip -> (y (B, T, H, P) in the compute
        dtype, the final state (B, H, P, N))."""
        compute = torch.promote_types(xs.dtype, torch.float32)
        y, S = mamba2_scan(xs, dt, self.decay_rates(xs.dtype, heads), Bs, Cs, chunk_size=self.chunk_size,
                           initial_state=initial_state, document_ids=document_ids)
        D = self.D[heads if heads is not None else slice(None)].to(compute)
        return y.to(compute) + D[:, None] * xs.to(compute), S  # the skip

    def decay_rates(self, dtype: torch.dtype, heads: slice | None = None) -> torch.Tensor:
        """A = -exp(A_log) (H,), negative (a decay), in the compute dtype of `dtype` inputs."""
        A_log = self.A_log[heads if heads is not None else slice(None)]
        return -A_log.to(torch.promote_types(dtype, torch.float32)).exp()

    def _channels(self, heads: slice | None, bc_width: int) -> tuple[slice, slice]:
        """The channels of x and of B, C (`bc_width` of them here) that `heads` read."""
        if heads is None:
            return slice(None), slice(None)
        per_group = self.A_log.shape[0] * self.state_size // self.conv_B.weight.shape[0]  # heads per group
        first = heads.start // per_group * self.state_size
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim), slice(first, first + bc_width)


def _convolve(x: torch.Tensor, conv: nn.Conv1d, part: slice, window: torch.Tensor | None,
              document_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` with the convolution's bias, on its channels `part`: causal_conv1d's kernel
    on CUDA for a sequence from nothing (training, a prompt), the PyTorch form otherwise (or
    without it)."""
    weight, bias = conv.weight[part], conv.bias[part] if conv.bias is not None else None
    kernel = causal_conv1d_kernel() if x.is_cuda and x.dtype != torch.float64 else None
    if kernel is None or window is not None or document_ids is not None:
        return causal_conv(x, weight, window, document_ids, bias)
    K = weight.shape[-1]
    out = kernel(x.transpose(1, 2), weight.squeeze(1), bias, activation="silu").transpose(1, 2)
    return out, F.pad(x, (0, 0, max(0, K - 1 - x.shape[1]), 0))[:, -(K - 1):]  # the last K - 1 inputs


def mamba2_init_rule(name: str, *, conv_kernel: int = 4, dt_min: float = 0.001, dt_max: float = 0.1,
                     dt_floor: float = 1e-4) -> tuple | None:
    """The init rule (forja.models.common.init) of a Mamba-2's own parameters, by name; None
    for those the host model's rule decides (projections; `norm.weight` is ones as every
    norm's). A = exp(A_log) ~ U(1, 16) and D = 1 (mamba_ssm's Mamba2); softplus(dt_bias)
    log-uniform in [dt_min, dt_max], at least dt_floor; the convolutions as PyTorch's default
    for a depthwise kernel (fan-in K)."""
    leaf = name.rsplit(".", 2)
    if leaf[-1] == "A_log":
        return ("uniform_log", 1.0, 16.0)
    if leaf[-1] == "D":
        return ("ones",)
    if leaf[-1] == "dt_bias":
        return ("inv_softplus", dt_min, dt_max, dt_floor)
    if len(leaf) >= 2 and leaf[-2] in ("conv_x", "conv_B", "conv_C"):
        bound = conv_kernel**-0.5
        return ("uniform", -bound, bound)
    return None


@dataclass(kw_only=True)
class Mamba2Args:
    """The Mamba-2 fields of a family whose `layer_types` hold "mamba2" blocks; listed before
    TransformerArgs among the bases, whose fields (dim, layer_type) it reads. Defaults:
    Nemotron-H's (transformers' NemotronHConfig)."""

    mamba_n_heads: int = 128
    """Mamba-2 heads."""
    mamba_head_dim: int = 64
    """Channels of one head (P); the inner width is mamba_n_heads * mamba_head_dim."""
    mamba_n_groups: int = 8
    """Groups of heads sharing B and C, and the gated norm's groups."""
    mamba_state_size: int = 128
    """Each head's state is mamba_head_dim x mamba_state_size (N)."""
    mamba_conv_kernel: int = 4
    """Taps of the short causal convolution over x, B and C."""
    mamba_chunk_size: int = 128
    """Tokens per chunk of the chunked scan."""
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)
    """The time step is clamped to [low, high] after its softplus."""
    mamba_dt_min: float = 0.001
    """softplus(dt_bias) is initialized log-uniform in [mamba_dt_min, mamba_dt_max]..."""
    mamba_dt_max: float = 0.1
    """See mamba_dt_min."""
    mamba_dt_floor: float = 1e-4
    """...and at least this."""
    mamba_conv_bias: bool = True
    """Biases on the convolutions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mamba_dt_limit = tuple(float(v) for v in self.mamba_dt_limit)  # a list from TOML or config.json
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ForjaError(f"model.mamba_n_heads={self.mamba_n_heads} is not a multiple of model.mamba_n_groups="
                             f"{self.mamba_n_groups}; each group shares B and C among whole heads")
        low, high = self.mamba_dt_limit
        if len(self.mamba_dt_limit) != 2 or not 0 <= low < high:
            raise ForjaError(f"model.mamba_dt_limit={list(self.mamba_dt_limit)} must be [low, high] with "
                             "0 <= low < high (the time step's clamp)")

    def head_counts(self) -> dict[str, int]:
        counts = super().head_counts()
        if "mamba2" in self.layer_types:  # tensor parallelism splits Mamba-2 by whole groups,
            # all-to-all context parallelism by whole heads (groups repeated where fewer than cp)
            counts.update(mamba_n_groups=self.mamba_n_groups, mamba_n_heads=self.mamba_n_heads)
        return counts

    def mamba2(self, norm_eps: float, bias: bool = False) -> Mamba2:
        """A Mamba-2 block's mixer; `norm_eps`: its gated norm's."""
        return Mamba2(self.dim, n_heads=self.mamba_n_heads, head_dim=self.mamba_head_dim,
                      n_groups=self.mamba_n_groups, state_size=self.mamba_state_size,
                      conv_kernel=self.mamba_conv_kernel, chunk_size=self.mamba_chunk_size,
                      dt_limit=self.mamba_dt_limit, bias=bias, conv_bias=self.mamba_conv_bias, norm_eps=norm_eps)

    def mamba2_flops(self, seq_len: int) -> int:
        """Training FLOPs per token of one Mamba-2 block's scan (Transformer.mixer_flops)."""
        return mamba2_scan_flops(self.mamba_n_heads, self.mamba_head_dim, self.mamba_state_size, seq_len,
                                 self.mamba_chunk_size)

    def mamba2_init_rule(self, name: str) -> tuple | None:
        """`mamba2_init_rule` for a parameter of a Mamba-2 block ("layers.{i}...."), None for
        every other parameter."""
        if name.startswith("layers.") and self.layer_type(int(name.split(".")[1])) == "mamba2":
            return mamba2_init_rule(name, conv_kernel=self.mamba_conv_kernel, dt_min=self.mamba_dt_min,
                                    dt_max=self.mamba_dt_max, dt_floor=self.mamba_dt_floor)
        return None
