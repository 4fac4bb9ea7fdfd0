"""The step engine's attention-logit bookkeeping (a step hook): the attn/ metrics and QK-clip (MuonClip).

With optim.qk_clip_tau > 0 or optim.max_logit_metric, every attention module keeps the max
logit of each of its heads over the step's forwards (forja/models/common/max_logit.py; the
engine's step context turns the tracking on). After the backward passes the maxima of all
layers and heads are laid out over the whole model, -inf where another rank holds them, and
recorded to be made whole by a max over every rank: data-parallel copies saw different tokens,
tensor-parallel ranks hold different heads, pipeline stages different layers. One more column
says which layers QK-clip may scale, so the count of clipped heads covers the whole model too.
After the optimizer step every rank clips its own heads with the same numbers, on the device,
so copies stay identical. The metrics:

    attn/max_logit          the largest logit of the step, over layers and heads
    attn/clipped_heads      heads whose weights QK-clip scaled this step
    attn/layer{i}/max_logit the same per layer

Which rows of which weight belong to a head, and with which power of gamma, is said here per
attention kind (forja/optim/qk_clip.py has the rule and the arithmetic). Context parallelism
splits a sequence's keys over ranks, which the local recomputation cannot see: the layout validator
refuses the pair (forja/parallel/checks.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from forja import fallbacks
from forja import metric_names as names
from forja.models.common.attention import Attention
from forja.models.common.max_logit import MaxLogitTracking
from forja.models.common.mla import MLA
from forja.optim.config import OptimConfig
from forja.optim.qk_clip import Segments, clip_factors, row_factors, scale_rows
from forja.parallel import ParallelDims
from forja.train.step.hooks import Reduce, StepDone, StepHook, Tally


def head_rows(module: nn.Module) -> list[tuple[torch.Tensor, Segments]] | None:
    """The tensors QK-clip scales in `module`, each with its per-head segments; None when
    scaling weights cannot move the logits (QK-norm renormalizes them)."""
    if isinstance(module, MLA):
        q = module.wq_b if module.q_lora else module.wq
        return [(q.weight, [(module.nope_dim, 0.5), (module.rope_dim, 1.0)]),  # q^C, q^R
                (module.wkv_b.weight, [(module.nope_dim, 0.5), (module.v_dim, 0.0)])]  # k^C, values
    if isinstance(module, Attention):
        if module.q_norm is not None:
            return None
        shared = module.wk.weight.shape[0] < module.wq.weight.shape[0]  # grouped-query: keys shared
        q_seg, k_seg = ([(module.head_dim, 1.0)], None) if shared else ([(module.head_dim, 0.5)],) * 2
        out = [(p, q_seg) for p in (module.wq.weight, module.wq.bias) if p is not None]
        if k_seg is not None:
            out += [(p, k_seg) for p in (module.wk.weight, module.wk.bias) if p is not None]
        return out
    return None


class AttentionLogits(StepHook):
    """The attention layers of this rank's model parts, their max logits and QK-clip."""

    def __init__(self, parts: list[nn.Module], dims: ParallelDims, cfg: OptimConfig):
        self.tau = cfg.qk_clip_tau
        self.enabled = self.tau > 0 or cfg.max_logit_metric
        args = parts[0].args
        self.rows, self.n_heads = args.n_layers + args.mtp_depth, args.n_heads  # the whole model's blocks
        self.device = next(parts[0].parameters()).device
        self.tp_rank = dist.get_rank(dims.tp_mesh.get_group()) if dims.tp > 1 else 0
        self.layers = sorted(((_layer_index(name), m) for part in parts for name, m in part.named_modules()
                              if isinstance(m, MaxLogitTracking)), key=lambda x: x[0])
        self.clippable = {i for i, m in self.layers if head_rows(m) is not None}
        if self.enabled and self.tau > 0 and len(self.clippable) < len(self.layers):
            fallbacks.record("optim.qk_clip", asked=f"optim.qk_clip_tau = {self.tau}",
                             instead="QK-clip leaves layers with QK-norm alone (their metric is still logged)",
                             why="the RMSNorm of q and k undoes any scaling of their projections", fix="")
        self._maxima = None

    def record(self, tally: Tally) -> None:
        """(rows, H + 1) float32: each held layer's max logit per head (TP: this rank's heads),
        -inf elsewhere, and a last column of 1 where the holder may clip the layer. A max over
        every rank completes it."""
        H = self.n_heads
        maxima = torch.full((self.rows, H + 1), -torch.inf, device=self.device)
        maxima[:, H] = 0.0
        for i, module in self.layers:
            local = module.take_max_logit()
            if local is not None:
                n = local.numel()
                maxima[i, self.tp_rank * n:(self.tp_rank + 1) * n] = local  # TP holds contiguous heads
            if i in self.clippable:
                maxima[i, H] = 1.0
        self._maxima = tally.add(maxima, Reduce.MAX, host=self._figures)

    def _figures(self, maxima: torch.Tensor) -> torch.Tensor:
        """(rows, H + 1) -> (2 rows + 1,): each layer's max, the model's, then each layer's heads
        that QK-clip scales (a factor below 1)."""
        heads, clippable = maxima[:, :self.n_heads], maxima[:, self.n_heads:] > 0  # (rows, H), (rows, 1)
        if self.tau > 0:
            clipped = ((clip_factors(heads, self.tau) < 1) & clippable).sum(dim=1)  # (rows,)
        else:
            clipped = torch.zeros(self.rows, device=heads.device)
        return torch.cat([heads.amax(dim=1), heads.max()[None], clipped.to(heads.dtype)])

    def end(self, done: StepDone) -> dict[str, float]:
        """The clip (if the optimizer stepped), on the device; the metrics."""
        host, R = self._maxima.host, self.rows
        per_layer, largest, clipped = host[:R], host[R], host[R + 1:]
        if done.stepped and self.tau > 0:
            for i, module in self.layers:
                if clipped[i]:  # else every factor is exactly 1: nothing would move
                    self._clip(module, self._maxima.device[i, :self.n_heads])
        metrics = {names.ATTN_MAX_LOGIT: largest, names.ATTN_CLIPPED_HEADS: sum(clipped) if done.stepped else 0.0}
        metrics.update({names.attn_layer_max_logit(i): v for i, v in enumerate(per_layer)})
        return metrics

    def _clip(self, module: nn.Module, maxima: torch.Tensor) -> None:
        """Scale `module`'s heads above tau by the maxima (H,) on the device."""
        gamma = clip_factors(maxima, self.tau)
        for tensor, segments in head_rows(module):
            scale_rows(tensor, row_factors(gamma, segments))


def _layer_index(name: str) -> int:
    digits = [p for p in name.split(".") if p.isdigit()]
    return int(digits[0]) if digits else 0
