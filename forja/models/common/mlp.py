"""Feed-forward blocks: SwiGLU (Llama), GeGLU (Gemma), GELU (GPT-2) and squared ReLU (Nemotron-H).

Each says what it adds to its block's structure record (`structure_fields`,
forja/models/common/blocks.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020, "GLU Variants Improve Transformer").

    `fused`: silu(gate) * up through forja.ops.swiglu (one kernel, no saved activation)."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = False, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from forja.ops import swiglu

            return self.w2(swiglu(self.w1(x), self.w3(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def structure_fields(self) -> dict:
        return {"ffn": "swiglu"}


class GeGLU(nn.Module):
    """w2(gelu_tanh(w1 x) * w3 x) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))

    def structure_fields(self) -> dict:
        return {"ffn": "geglu"}


class GeluMLP(nn.Module):
    """w2(gelu(w1 x)) with GPT-2's tanh approximation of GELU."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = True):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def structure_fields(self) -> dict:
        return {"ffn": "gelu"}


class SquaredReLUMLP(nn.Module):
    """w2(relu(w1 x)^2), no gate (So et al. 2021, "Primer"; Nemotron-H's MLP and experts)."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())

    def structure_fields(self) -> dict:
        return {"ffn": "relu2"}
