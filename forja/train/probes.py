"""Activation sizes at validation: the mean |x| of the last block's output (the residual
stream before the final norm) and of the logits, averaged over the validation batches.

They are the coordinates a muP coordinate check watches (Yang et al. 2021, "Tensor Programs
V"): under muP they stay flat as the model widens, under the standard parametrization the
logits grow. Logged with every validation (val_act_hidden, val_act_logits), so a `forja
sweep` over widths plots them (coords.png) and any run shows whether its activations drift.
Each rank hooks the modules it holds: the logits only exist where the output projection
runs outside the fused loss, and a pipeline's last block lives on its last stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ActivationSizes:
    """Hooks, while entered, that add up mean |output| of the last block and the output layer."""

    def __init__(self, parts: list[nn.Module]):
        self.modules: dict[str, nn.Module] = {}
        last = max(((int(i), block) for part in parts for i, block in part.layers.items()), default=None,
                    key=lambda ib: ib[0])
        if last is not None:
            self.modules["val_act_hidden"] = last[1]
        outputs = [part for part in parts if getattr(part, "output", None) is not None]
        if outputs:
            self.modules["val_act_logits"] = outputs[0].output
        # muP multiplies the output layer's result by 1/width_mult (Transformer.logits): the
        # logits are that product, not what the output layer returns.
        self.scale = {"val_act_logits": 1.0 / outputs[0].args.mup_width_mult} if outputs else {}
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.handles: list = []

    def __enter__(self) -> ActivationSizes:
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name: str):
        def record(module, args, output):
            local = output.to_local() if isinstance(output, DTensor) else output  # a TP shard says as much
            value = local.detach().float().abs().mean() * self.scale.get(name, 1.0)
            self.sums[name] = self.sums.get(name, 0.0) + value
            self.counts[name] = self.counts.get(name, 0) + 1
        return record

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def means(self) -> dict[str, float]:
        """The sizes seen (one host sync for all of them)."""
        if not self.sums:
            return {}
        names = list(self.sums)
        values = torch.stack([self.sums[n] / self.counts[n] for n in names]).tolist()
        return dict(zip(names, values))
