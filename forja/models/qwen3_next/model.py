"""Qwen3-Next (Qwen team, 2025), single-device: Qwen3.5's hybrid of Gated DeltaNet and
gated attention, one generation earlier, as a mixture of experts.

The blocks compute what Qwen3.5-MoE's do (forja/models/qwen3_5/model.py): Gated DeltaNet
in three of every four, gated partially rotary attention in the fourth, zero-centered
RMSNorms, a softmax top-k router and one shared expert scaled by a per-token sigmoid gate.
What is Qwen3-Next's own:

- which blocks hold the mixture of experts: Qwen3-MoE's rule, every `decoder_sparse_step`-th
  block but those in `mlp_only_layers`, which keep a dense SwiGLU of `ffn_dim`;
- the renormalization of the top-k weights is optional (`norm_topk_prob`);
- its checkpoints fuse the Gated DeltaNet's projections differently (forja/models/qwen3_next/hf.py);
  the modules here are the same.

- one multi-token prediction module in the published checkpoints (`mtp_depth` 1, off in
  the flavors as transformers builds none): forja/models/common/mtp.py's MTPModule around a
  gated-attention block, its norms zero-centered like every other. Whether that block has
  experts follows its index in the checkpoint's `mtp.layers` (0), as vLLM, the engine the
  published weights ship for, decides it (`is_moe_layer(0)`: experts in the published model).
"""

from __future__ import annotations

from dataclasses import dataclass

from forja.errors import ForjaError
from forja.models.qwen3_5.model import Qwen3_5, Qwen3_5Args


@dataclass(kw_only=True)
class Qwen3NextArgs(Qwen3_5Args):
    """A Qwen3-Next model's shape; the package's FLAVORS hold the published one. Qwen3.5's fields,
    plus which blocks are a mixture of experts; `n_experts=0` makes every block dense."""

    decoder_sparse_step: int = 1
    """Every this-many-th block (1-based) is a mixture of experts; 1: all of them."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks (0-based) that stay dense (a SwiGLU of `ffn_dim`) whatever `decoder_sparse_step` says."""

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(int(i) for i in self.mlp_only_layers)  # a list from TOML or config.json
        if self.decoder_sparse_step < 1:
            raise ForjaError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be at least 1")
        super().__post_init__()
        dense = [i for i in range(self.n_layers) if not self.is_moe_layer(i)]
        if self.n_experts > 0 and len(dense) == self.n_layers:
            raise ForjaError(f"model.n_experts={self.n_experts} but no block is a mixture of experts "
                             f"(decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                             f"{list(self.mlp_only_layers)}); set n_experts=0 for a dense model")
        if dense and self.ffn_dim <= 0:
            raise ForjaError(f"model.ffn_dim={self.ffn_dim} but block {dense[0]} is dense (decoder_sparse_step="
                             f"{self.decoder_sparse_step}, mlp_only_layers={list(self.mlp_only_layers)}); "
                             "give the dense blocks a width")

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


class Qwen3Next(Qwen3_5):
    """Qwen3.5's model, its MTP module included: its blocks follow `Qwen3NextArgs.is_moe_layer`,
    which RotaryDecoder.build_feed_forward asks."""

    args: Qwen3NextArgs
