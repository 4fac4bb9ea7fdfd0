"""Multi-token prediction (MTP): DeepSeek-V3's sequential modules (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, arXiv 2412.19437, section 2.2), single-device.

Depth k (1..D) predicts, at position i, the token t_{i+k+1}. It combines the previous depth's
hidden state h^{k-1}_i (depth 0: the main model's) with the embedding of the token t_{i+k},
each RMS-normalized, projects the pair 2d -> d, runs one transformer block and a final norm,
and the main model's output head turns the result into logits:

    h'_i = proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])       (B, T, 2d) -> (B, T, d)
    h^k  = norm(block(h'))                                      (B, T, d)
    L_k  = CE(head(h^k)_i, t_{i+k+1})  over the positions whose target is in i's document
    L_MTP = (loss_weight / D) * sum_k L_k                       added to the main loss

The embedding and the output head are the main model's (shared, not copied). What flows
from one depth to the next, and from the main model into depth 1, is the normalized
state the head reads: the main model's output after its final norm, each depth's after its
own. The report writes the concatenation as [h; emb]; every implementation that runs the
published weights (DeepSeek's inference partners vLLM and SGLang, Megatron-LM's training
code) puts the embedding first, so forja does too and `proj` loads the published `eh_proj`
as it is. Both choices train alike from scratch (a permutation of proj's columns).

Packed rows: a depth's inputs and targets never cross a document. The target of position
i at depth k is t_{i+k+1}, read from the main labels (labels[i + k]); it counts only when
position i + k + 1 lies in the row and in i's document, otherwise the label is -100 and
ignored. The block attends within documents (the main model's mask), so a position whose
target counts sees only tokens of its own document: the later positions of a document have
inputs from the next one, but their targets are ignored and no earlier position sees them.

A family reuses this with its own block and tensor names: `MultiTokenPrediction` takes the
blocks to run (anything called as block(x, rope, mask)), a norm factory and the index of the
first module ("layers.{first + k - 1}"; DeepSeek-V3's checkpoints number them after the main
layers), and optionally its own module class: DeepSeek-V4's carries its `hc_mult` residual
streams from depth to depth and collapses them only for the head (`head_input`).
Qwen3-Next's single module (`mtp.fc`, `mtp.pre_fc_norm_hidden`,
`mtp.pre_fc_norm_embedding`, `mtp.layers.0`, `mtp.norm`) is one depth whose HF rules name
proj, hnorm, enorm, block and norm.

The modules are used in training only (`Transformer.forward` with labels, in train mode):
validation reports the main loss and generation never runs them. Their losses reach the
gradients through `AddAuxLoss` (the MoE auxiliary losses' route), scaled by the step context's
`aux_loss_share`, which the step engine sets to each micro-batch's share of the step
(forja/models/common/step_context.py, forja/train/step/mtp.py);
the value returned stays the main loss, so loss curves are comparable with and without MTP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from forja.models.common.step_context import OUTSIDE_A_STEP, AddAuxLoss

IGNORE = -100  # the cross-entropy's ignore_index: positions whose target is not counted


def mtp_targets(tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth k's inputs and targets: (B, T) token ids t_{i+k} (0 past the row's end, where
    no target counts) and (B, T) targets t_{i+k+1}, IGNORE where position i + k + 1 is past
    the row or, with `document_ids` (B, T), in another document than position i."""
    B, T = tokens.shape
    inputs = torch.zeros_like(tokens)  # (B, T)
    inputs[:, :T - k] = tokens[:, k:]
    targets = torch.full_like(labels, IGNORE)  # (B, T)
    n = T - k - 1  # positions whose target position i + k + 1 is inside the row
    if n > 0:
        kept = labels[:, k:k + n]  # (B, n): labels[i + k] = t_{i+k+1}
        if document_ids is not None:  # ids are contiguous runs: same ends -> same document throughout
            kept = kept.masked_fill(document_ids[:, k + 1:k + 1 + n] != document_ids[:, :n], IGNORE)
        targets[:, :n] = kept
    return inputs, targets


class MTPModule(nn.Module):
    """One depth: (previous hidden (B, T, d), next-token embeddings (B, T, d)) -> (B, T, d)."""

    def __init__(self, dim: int, block: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.hnorm = norm()
        self.enorm = norm()
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = norm()

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope, mask) -> torch.Tensor:
        """What the next depth reads: here the normalized state the head reads too."""
        x = self.proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # (B, T, 2d) -> (B, T, d)
        return self.norm(self.block(x, rope, mask))  # (B, T, d)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The (B, T, d) state the output head reads from this depth's output."""
        return h


@dataclass
class MTPStats:
    """What the modules saw since the engine last read them: per-depth sums of the
    (unweighted) mean losses, on the device, and the number of forwards."""

    losses: list[torch.Tensor | float] = field(default_factory=list)
    forwards: int = 0


class MultiTokenPrediction(nn.Module):
    """`depth` sequential modules after a main model, and their losses."""

    def __init__(self, dim: int, blocks: list[nn.Module], norm: Callable[[], nn.Module], *, first: int,
                 loss_weight: float, module: Callable[..., nn.Module] = MTPModule):
        super().__init__()
        # Keyed by the layer index a checkpoint gives each module (DeepSeek-V3: after the main layers);
        # a mixture of experts in a block is then reported as that layer (forja/train/step/experts.py).
        self.layers = nn.ModuleDict({str(first + k): module(dim, b, norm) for k, b in enumerate(blocks)})
        self.loss_weight = loss_weight
        self.step_context = OUTSIDE_A_STEP  # the step engine's: this micro-batch's share of the step's loss
        # A pipeline's last stage holds its own copy of the token embedding here (set by
        # forja/parallel/pp_split.py; Transformer.tied_parameters keeps it equal); else None.
        self.embed: nn.Embedding | None = None
        self.stats = MTPStats()

    @property
    def depth(self) -> int:
        return len(self.layers)

    def losses(self, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
               document_ids: torch.Tensor | None, *, embed: nn.Module,
               head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rope, mask) -> list[torch.Tensor]:
        """The mean cross-entropy of each depth (0-dim each, depth 1 first), from the main
        model's final (normalized) hidden states h (B, T, d) (DeepSeek-V4: its residual streams
        (B, T, n, d) before their collapse), its tokens and labels (B, T) and document ids
        (B, T) or None. `head_loss(h, targets)` is the main model's output head and loss (mean
        over the targets that are not IGNORE)."""
        out = []
        for k, module in enumerate(self.layers.values(), start=1):
            inputs, targets = mtp_targets(tokens, labels, document_ids, k)  # (B, T) each
            h = module(h, embed(inputs), rope, mask)  # what depth k + 1 reads
            out.append(head_loss(module.head_input(h), targets))
        return out

    def attach(self, loss: torch.Tensor, losses: list[torch.Tensor]) -> torch.Tensor:
        """`loss` unchanged, with (loss_weight / depth) * sum(losses) entering its backward at
        the step context's `aux_loss_share`; records the losses for the engine's metrics."""
        weighted = (self.loss_weight / len(losses)) * torch.stack(losses).sum()  # (,)
        if torch.is_grad_enabled():
            # A copy, not AddAuxLoss's view: FSDP warns of a model output that is a view.
            loss = AddAuxLoss.apply(loss, weighted, self.step_context.aux_loss_share).clone()
        s = self.stats
        if not s.losses:
            s.losses = [0.0] * len(losses)
        s.losses = [total + value.detach().float() for total, value in zip(s.losses, losses)]
        s.forwards += 1
        return loss

    def take_stats(self) -> MTPStats:
        """The statistics since the last call, and a fresh start."""
        stats, self.stats = self.stats, MTPStats()
        return stats


def mtp_modules(model: nn.Module) -> list[MultiTokenPrediction]:
    """The MultiTokenPrediction of a model (or pipeline stage), if it holds one."""
    return [m for m in model.modules() if isinstance(m, MultiTokenPrediction)]
