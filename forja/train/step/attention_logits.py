"""The step engine's attention-logit bookkeeping: the attn/ metrics and QK-clip (MuonClip).

With optim.qk_clip_tau > 0 or optim.max_logit_metric, every attention module keeps the max
logit of each of its heads over the step's forwards (forja/models/common/max_logit.py). After
the optimizer step the maxima of all layers and heads are made whole in one all-reduce (MAX)
over every rank: data-parallel copies saw different tokens, tensor-parallel ranks hold
different heads, pipeline stages different layers, and every rank then clips its own heads
with the same numbers, so copies stay identical. The metrics:

    attn/max_logit          the largest logit of the step, over layers and heads
    attn/clipped_heads      heads whose weights QK-clip scaled this step
    attn/layer{i}/max_logit the same per layer

Which rows of which weight belong to a head, and with which power of gamma, is said here per
attention kind (forja/optim/qk_clip.py has the rule and the arithmetic). Context parallelism
splits a sequence's keys over ranks, which the local recomputation cannot see: refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from forja import fallbacks
from forja.models.common.attention import Attention
from forja.models.common.max_logit import MaxLogitTracking
from forja.models.common.mla import MLA
from forja.optim.config import OptimConfig
from forja.optim.qk_clip import Segments, clip_factors, row_factors, scale_rows
from forja.parallel import ParallelDims


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


class AttentionLogits:
    """The attention layers of this rank's model parts, their max logits and QK-clip."""

    def __init__(self, parts: list[nn.Module], dims: ParallelDims, cfg: OptimConfig):
        self.tau = cfg.qk_clip_tau
        self.enabled = self.tau > 0 or cfg.max_logit_metric
        self.dims = dims
        self.n_layers, self.n_heads = parts[0].args.n_layers, parts[0].args.n_heads  # the whole model's
        self.device = next(parts[0].parameters()).device
        self.layers = sorted(((_layer_index(name), m) for part in parts for name, m in part.named_modules()
                              if isinstance(m, MaxLogitTracking)), key=lambda x: x[0])
        for _, module in self.layers:
            module.track_max_logit = self.enabled
        if self.enabled and self.tau > 0 and any(head_rows(m) is None for _, m in self.layers):
            fallbacks.record("optim.qk_clip", asked=f"optim.qk_clip_tau = {self.tau}",
                             instead="QK-clip leaves layers with QK-norm alone (their metric is still logged)",
                             why="the RMSNorm of q and k undoes any scaling of their projections", fix="")

    def end_step(self, stepped: bool) -> dict[str, float]:
        """The step's maxima, made whole; the clip (if the optimizer stepped); the metrics."""
        if not self.enabled:
            return {}
        maxima = self._gathered()  # (L, H) over the whole model
        clipped = 0
        if stepped and self.tau > 0:
            for i, module in self.layers:
                clipped += self._clip(module, maxima[i])
        metrics = {"attn/max_logit": float(maxima.max()), "attn/clipped_heads": float(clipped)}
        per_layer = maxima.amax(dim=1).tolist()
        metrics.update({f"attn/layer{i}/max_logit": v for i, v in enumerate(per_layer)})
        return metrics

    def _gathered(self) -> torch.Tensor:
        """(n_layers, H) max logits: each rank fills its layers and heads, -inf elsewhere, and a
        MAX over every rank completes them. The same tensor on every rank."""
        taken = [(i, m, m.take_max_logit()) for i, m in self.layers]
        maxima = torch.full((self.n_layers, self.n_heads), -torch.inf, device=self.device)
        tp_rank = dist.get_rank(self.dims.tp_mesh.get_group()) if self.dims.tp > 1 else 0
        for i, _, local in taken:
            if local is not None:
                n = local.numel()
                maxima[i, tp_rank * n:(tp_rank + 1) * n] = local  # TP holds contiguous heads
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        return maxima.cpu()

    def _clip(self, module: nn.Module, maxima: torch.Tensor) -> int:
        """Scale `module`'s heads above tau; the number scaled."""
        rows = head_rows(module)
        if rows is None:
            return 0
        gamma = clip_factors(maxima, self.tau)
        for tensor, segments in rows:
            scale_rows(tensor, row_factors(gamma, segments))
        return int((gamma < 1).sum())


def _layer_index(name: str) -> int:
    digits = [p for p in name.split(".") if p.isdigit()]
    return int(digits[0]) if digits else 0
